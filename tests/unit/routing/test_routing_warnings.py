"""A clean log on every popular family (issue 58): the probes of
``tests/support/warning_probes.py`` (encoder-decoders, dual encoders, MoE variants, blocks
of the family table) route with the routing warning docs/routing_warnings.md gives them,
and that table lists every family the routing tests build.

Needs the ``models`` extra (``transformers``).
"""

from __future__ import annotations

import pytest
from warning_probes import PROBES, documented, families_tested, warning_lines

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


@pytest.mark.parametrize("family", PROBES)
def test_probed_family_warns_as_documented(family: str) -> None:
    assert warning_lines(PROBES[family]()) == documented()[(family, "tiny")]


def test_the_warning_table_lists_every_family_the_routing_tests_build() -> None:
    assert list(documented()) == list(families_tested()), "run: python tools/family_table.py"
