"""The slow tier of test_in_place_parity.py: every other layout, precision and rule."""

from __future__ import annotations

import pytest
from test_in_place_parity import cases
from test_in_place_parity import test_in_place_equals_packed as check


@pytest.mark.parametrize(("world_size", "name", "precision", "rule"), cases(quick=False))
def test_in_place_equals_packed(world_size: int, name: str, precision: str, rule: str) -> None:
    check(world_size, name, precision, rule)
