"""Where test files live: the test folders mirror the package's layers (the rule is written
in tests/conftest.py's docstring and the README's "Tests"; test_architecture.py holds the
package's own layers)."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT
from test_architecture import LAYERS, PACKAGE, _imports

TESTS = ROOT / "tests"
TOP_FOLDER = "optimizer"  # tests/unit/optimizer: optimizer.py, qk_clip.py, the package's API
UNIT_FOLDERS = {layer or TOP_FOLDER: rank for layer, rank in LAYERS.items()}
SUPPORT = TESTS / "support"


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _module_imports(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (``a`` for ``import a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def _layer_of(module: str) -> str | None:
    """The unit folder of a ``muon_dist`` module; None for the package's API (``muon_dist``,
    or a name imported from it)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] in UNIT_FOLDERS:
        return parts[1]
    return TOP_FOLDER if (PACKAGE / f"{parts[1]}.py").exists() else None


def test_every_test_file_is_in_a_test_folder() -> None:
    """tests/unit/<layer>/, tests/distributed/<topic>/, tests/gpu/ or tests/tooling/; none
    directly in tests/ and none in tests/support/."""
    wrong = []
    for path in _test_files():
        folder = path.parent.relative_to(TESTS).parts
        match folder:
            case ("unit", layer) if layer in UNIT_FOLDERS:
                pass
            case ("distributed", _) | ("gpu",) | ("tooling",):
                pass
            case _:
                wrong.append(str(path.relative_to(ROOT)))
    assert wrong == []


def test_unit_tests_import_their_layer_and_below() -> None:
    """A test in tests/unit/<layer>/ imports no muon_dist module of a higher layer (it may
    drive its layer through the package's API, ``import muon_dist``), and spawns no ranks."""
    wrong = []
    for path in sorted((TESTS / "unit").rglob("*.py")):
        mine = UNIT_FOLDERS[path.parent.name]
        for imported in _imports(path):
            layer = _layer_of(imported)
            if layer is not None and UNIT_FOLDERS[layer] > mine:
                wrong.append(f"{path.relative_to(ROOT)} imports {imported}")
        if "dist_harness" in _module_imports(path):
            wrong.append(f"{path.relative_to(ROOT)} spawns ranks: tests/distributed/<topic>/")
    assert wrong == []


def test_workers_sit_beside_their_tests() -> None:
    """A module that is not a test (a ``*_cases.py`` worker, a helper) sits beside a test that
    imports it, or in tests/support/ (helpers for several folders, no workers); module names
    are unique across tests/, which puts every folder on ``sys.path``."""
    modules = [p for p in sorted(TESTS.rglob("*.py")) if p.name != "conftest.py"]
    names = [p.stem for p in modules]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    wrong = []
    for path in modules:
        if path.name.startswith("test_"):
            continue
        if path.parent == SUPPORT:
            if path.name.endswith("_cases.py"):
                wrong.append(f"{path.relative_to(ROOT)}: a worker, beside its test")
            continue
        users = [t for t in path.parent.glob("test_*.py") if path.stem in _module_imports(t)]
        if not users:
            wrong.append(f"{path.relative_to(ROOT)}: no test beside it imports it")
    assert wrong == []


def test_tiers_are_chosen_by_path() -> None:
    """conftest.py marks a test_*_slow.py file's tests ``slow`` and tests/gpu/'s ``gpu``; no
    test file marks itself, so the file name and the folder say the tier."""
    wrong = [
        str(path.relative_to(ROOT))
        for path in _test_files()
        if any(f"mark.{mark}" in path.read_text() for mark in ("slow", "gpu"))
    ]
    assert wrong == []
