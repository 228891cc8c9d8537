"""The package's folders are its layers, and imports run one way: down the layers.

kernels, runtime <- rules <- plan <- options <- routing, comm <- state <- step <- the top
(optimizer, qk_clip, integrations). A module imports from its own folder or a lower layer,
never from a higher one or from a sibling layer (routing and comm do not know each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT

from muon_dist.rules.registry import RULES

PACKAGE = ROOT / "muon_dist"
LAYERS = {
    "kernels": 0,
    "runtime": 0,
    "rules": 1,
    "plan": 2,
    "options": 3,
    "routing": 4,
    "comm": 4,
    "state": 5,
    "step": 6,
    "": 7,  # optimizer.py, qk_clip.py, __init__.py
    "integrations": 8,
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in PACKAGE.rglob("*.py")
    }


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def _imports(path: Path) -> set[str]:
    """Every muon_dist module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("muon_dist"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("muon_dist"))
    return found


def test_every_folder_has_a_layer() -> None:
    assert {_folder(m) for m in _modules()} == set(LAYERS)


def test_imports_run_down_the_layers() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        mine = _folder(module)
        for imported in _imports(path) & set(modules):
            theirs = _folder(imported)
            if theirs == mine or imported == "muon_dist":
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def _reads_rule(node: ast.AST) -> bool:
    """``group["rule"]`` or ``group.get("rule", ...)``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "rule"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "rule"
    )


def test_only_the_registry_compares_rule_names() -> None:
    """A rule is an object; outside muon_dist/rules no code compares a group's rule or a
    rule's name ("muon" is also an algorithm's name, compared as such)."""
    names = set(RULES) - {"muon"}
    found = []
    for module, path in _modules().items():
        if _folder(module) == "rules":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(
                    _reads_rule(o) or (isinstance(o, ast.Constant) and o.value in names)
                    for o in operands
                ):
                    found.append(f"{module}:{node.lineno}")
    assert found == []


# Where tests live (tests/conftest.py's docstring and the README's "Tests" say the same).
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
