"""Rewrite the README's package layout from the modules' own docstrings.

The block between ``<!-- layout:package -->`` and ``<!-- /layout:package -->`` lists every
folder and module of ``muon_dist/``, top layer first, each with the first sentence of its
docstring, so the list cannot drift from the code: a test renders it again and compares.
Run after adding, moving or re-describing a module: ``python tools/layout_table.py``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "muon_dist"
START, END = "<!-- layout:package -->", "<!-- /layout:package -->"
# Top of the stack first, as a reader meets them (docs/architecture.md draws the same).
FOLDERS = (
    "",
    "integrations",
    "step",
    "state",
    "comm",
    "routing",
    "options",
    "plan",
    "rules",
    "runtime",
    "kernels",
)
# Folders with rooms of their own, top of the stack first (tests/tooling/test_architecture.py
# holds their imports to this order).
SUBFOLDERS = {"step": ("launch", "program", "wings", "bucket", "agree", "shard")}
NAME_WIDTH = 27
WIDTH = 100


def summary(path: Path) -> str:
    """The first sentence of ``path``'s module docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no module docstring; give it one")
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    paragraph = re.sub(r":(?:class|func|meth|mod|attr):`([^`]+)`", r"\1", paragraph)
    paragraph = paragraph.replace("``", "`")
    match = re.match(r"(.+?)\.(?:\s+[A-Z(`]|$)", paragraph)
    return match.group(1) if match else paragraph.rstrip(".")


def _line(name: str, text: str, indent: int) -> list[str]:
    head = " " * indent + name
    pad = max(NAME_WIDTH, len(head) + 1)
    wrapped = textwrap.wrap(text, WIDTH - pad) or [""]
    first = f"{head.ljust(pad)}{wrapped[0]}"
    return [first] + [" " * pad + rest for rest in wrapped[1:]]


def layout() -> str:
    """The package's folders and modules with their summaries, as a fenced block."""
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    unknown = found - set(FOLDERS)
    if unknown:
        raise ValueError(
            f"muon_dist/ folders {sorted(unknown)} are not in tools/layout_table.py's FOLDERS; "
            "add each at its layer"
        )
    lines: list[str] = []
    for folder in FOLDERS:
        base = PACKAGE / folder if folder else PACKAGE
        modules = sorted(p for p in base.glob("*.py") if p.name != "__init__.py")
        if folder:
            lines += _line(f"muon_dist/{folder}/", summary(base / "__init__.py"), 0)
            for module in modules:
                lines += _line(module.name, summary(module), 2)
            lines += _rooms(base, SUBFOLDERS.get(folder, ()))
        else:
            for module in modules:
                lines += _line(f"muon_dist/{module.name}", summary(module), 0)
    return "```\n" + "\n".join(lines) + "\n```"


def _rooms(base: Path, rooms: tuple[str, ...]) -> list[str]:
    """The sub-folders ``rooms`` of ``base`` and their modules, indented one step further."""
    found = {p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    if found != set(rooms):
        raise ValueError(
            f"{base.relative_to(ROOT)}/ has sub-folders {sorted(found)}, tools/layout_table.py's "
            f"SUBFOLDERS {sorted(rooms)}: list each at its place"
        )
    lines: list[str] = []
    for room in rooms:
        lines += _line(f"{room}/", summary(base / room / "__init__.py"), 2)
        for module in sorted(p for p in (base / room).glob("*.py") if p.name != "__init__.py"):
            lines += _line(module.name, summary(module), 4)
    return lines


def replace_section(text: str, block: str) -> str:
    """``text`` with the layout section replaced by ``block``."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


def main() -> None:
    readme = ROOT / "README.md"
    readme.write_text(replace_section(readme.read_text(), layout()))


if __name__ == "__main__":
    main()
