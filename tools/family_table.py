"""Rewrite the README's model-family table from the model-family tests.

The table between ``<!-- table:families -->`` and ``<!-- /table:families -->`` is rendered
by ``tests/support/model_families.py`` from the same tiny transformers models whose
routing ``tests/unit/routing/test_model_families.py`` checks, so it says what each family's
parameters get and why. Run after changing the routing or the families:
``python tools/family_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- table:families -->", "<!-- /table:families -->"


def replace_section(text: str, table: str) -> str:
    """``text`` with the family table's section replaced by ``table``."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from model_families import family_table

    readme = ROOT / "README.md"
    readme.write_text(replace_section(readme.read_text(), family_table()))


if __name__ == "__main__":
    main()
