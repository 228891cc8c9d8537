"""The package's folders are its layers, and imports run one way: down the layers.

kernels, runtime <- rules <- plan <- options <- routing, comm <- state <- step <- the top
(optimizer, qk_clip, integrations). A module imports from its own folder or a lower layer,
never from a higher one or from a sibling layer (routing and comm do not know each other).
Inside step/ the sub-folders are sub-layers along the step: shard <- agree <- bucket <-
wings <- program <- launch <- step/'s own modules (runner, adamw_phase, changes). Where the
tests of each layer live is checked beside this file, in test_test_layout.py.
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
# Sub-layers of a layer with sub-folders, bottom first; "" is the layer's own modules.
SUB_LAYERS = {"step": ("shard", "agree", "bucket", "wings", "program", "launch", "")}
MAX_MODULES_PER_FOLDER = 8


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


def _sub_layer(module: str) -> tuple[str, int] | None:
    """The layer and sub-layer of a module of a layer with sub-folders (None elsewhere)."""
    parts = module.split(".")
    rooms = SUB_LAYERS.get(parts[1]) if len(parts) > 2 else None
    if rooms is None:
        return None
    room = parts[2] if len(parts) > 3 else ""
    return parts[1], rooms.index(room)


def test_every_sub_folder_has_a_sub_layer() -> None:
    found = {(s[0], SUB_LAYERS[s[0]][s[1]]) for m in _modules() if (s := _sub_layer(m))}
    assert found == {(layer, room) for layer, rooms in SUB_LAYERS.items() for room in rooms}


def test_imports_run_down_the_sub_layers() -> None:
    """Inside step/: shard <- agree <- bucket <- wings <- program <- launch <- runner; a
    module imports from its own sub-folder or a lower one."""
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        mine = _sub_layer(module)
        if mine is None:
            continue
        for imported in _imports(path) & set(modules):
            theirs = _sub_layer(imported)
            if theirs is not None and theirs[0] == mine[0] and theirs[1] > mine[1]:
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def test_no_folder_holds_more_than_eight_modules_of_a_sub_layered_layer() -> None:
    too_many = []
    for layer in SUB_LAYERS:
        for folder in [PACKAGE / layer, *(p for p in (PACKAGE / layer).iterdir() if p.is_dir())]:
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES_PER_FOLDER:
                too_many.append(f"{folder.relative_to(ROOT)}: {count}")
    assert too_many == []


def test_every_rule_declares_a_wing_named_for_it() -> None:
    """A rule's wing (its "module:Class") is a Wing in muon_dist/step/wings/, in a module
    named for the rule (Muon's is the base every other wing changes)."""
    from muon_dist.step.wings.base import Wing
    from muon_dist.step.wings.registry import wing_of

    for rule in RULES.values():
        module, _, _ = rule.wing.partition(":")
        assert module == f"muon_dist.step.wings.{rule.name}", rule.name
        assert issubclass(wing_of(rule), Wing)


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


def _top_level_public_names(path: Path) -> list[str]:
    """The public classes and UPPER_CASE constants ``path`` defines at its top level."""
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names += [node.target.id] if node.target.id.isupper() else []
    return [name for name in names if not name.startswith("_")]


def test_no_public_class_or_constant_is_defined_twice() -> None:
    """One name, one meaning: a public class or module constant has one definition."""
    where: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for name in _top_level_public_names(path):
            where.setdefault(name, []).append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert twice == {}


def _docstring_lines(cls: ast.ClassDef) -> int:
    """Lines of the docstrings of a class and of everything defined in it."""
    count = 0
    for node in ast.walk(cls):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                and first.end_lineno is not None
            ):
                count += first.end_lineno - first.lineno + 1
    return count


def _attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class body declares and its methods assign on ``self``."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


MAX_CLASS_LINES, MAX_CLASS_ATTRIBUTES = 300, 25


def test_no_class_grew_back() -> None:
    """No class over 300 lines or with more than 25 attributes, docstrings excluded."""
    grown = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
            attributes = len(_attributes(node))
            if lines > MAX_CLASS_LINES or attributes > MAX_CLASS_ATTRIBUTES:
                grown.append(f"{module}.{node.name}: {lines} lines, {attributes} attributes")
    assert grown == []


def test_readme_layout_is_rendered_from_the_module_docstrings() -> None:
    """The README's package layout is the modules' own summaries, so it cannot drift."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "layout_table", ROOT / "tools" / "layout_table.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    readme = (ROOT / "README.md").read_text()
    section = readme.split(tool.START, 1)[1].split(tool.END, 1)[0].strip()
    assert section == tool.layout(), "run: python tools/layout_table.py"
