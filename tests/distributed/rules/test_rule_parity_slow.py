"""The slow tier of test_rule_parity.py: NorMuon and Dion2 on every other layout and cut,
on 1 to 4 ranks."""

from __future__ import annotations

import pytest
from normuon_cases import layouts
from parity_cases import case_names
from test_rule_parity import cases
from test_rule_parity import test_parity_layouts as check_layout
from test_rule_parity import test_views_and_parts as check_views


@pytest.mark.parametrize(("rule", "world_size", "name"), cases(case_names, quick=False))
def test_parity_layouts(rule: str, world_size: int, name: str) -> None:
    check_layout(rule, world_size, name)


@pytest.mark.parametrize(("rule", "world_size", "layout"), cases(layouts, quick=False))
def test_views_and_parts(rule: str, world_size: int, layout: str) -> None:
    check_views(rule, world_size, layout)
