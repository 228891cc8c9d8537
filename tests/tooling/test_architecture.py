"""The package's folders are its layers, and imports run one way: down the layers.

kernels, runtime <- rules <- plan <- options <- routing, comm <- state <- step <- the top
(optimizer, qk_clip, integrations). A module imports from its own folder or a lower layer,
never from a higher one or from a sibling layer (routing and comm do not know each other).
Where the tests of each layer live is checked beside this file, in test_test_layout.py.
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
