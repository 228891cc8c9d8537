"""Rewrite the README's model-family table and warning table from the routing tests.

The table between ``<!-- table:families -->`` and ``<!-- /table:families -->`` is rendered
by ``tests/support/model_families.py`` from the same tiny transformers models whose
routing ``tests/unit/routing/test_model_families.py`` checks, so it says what each family's
parameters get and why. The table of ``docs/routing_warnings.md`` (between
``<!-- table:warnings -->`` and ``<!-- /table:warnings -->``) says how many lines of
routing warning each family the routing tests build gets, and how many parameters they
cover (``tests/support/warning_probes.py``); the tests that route each family hold its
row.
Run after changing the routing or the families: ``python tools/family_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- table:families -->", "<!-- /table:families -->"
WARNINGS_DOC = "docs/routing_warnings.md"


def replace_section(text: str, table: str, start: str = START, end: str = END) -> str:
    """``text`` with the section between ``start`` and ``end`` (the family table's)
    replaced by ``table``."""
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    sys.path.insert(0, str(ROOT / "tests" / "unit" / "routing"))
    import warning_probes
    from model_families import family_table

    readme = ROOT / "README.md"
    readme.write_text(replace_section(readme.read_text(), family_table()))
    doc = ROOT / WARNINGS_DOC
    table = warning_probes.warning_table(warning_probes.all_warning_counts())
    doc.write_text(
        replace_section(doc.read_text(), table, warning_probes.START, warning_probes.END)
    )


if __name__ == "__main__":
    main()
