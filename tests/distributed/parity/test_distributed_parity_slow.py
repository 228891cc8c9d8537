"""The slow tier of test_distributed_parity.py: every other layout on 1 to 4 ranks, in each
precision."""

from __future__ import annotations

import pytest
from test_distributed_parity import cases
from test_distributed_parity import test_sharded_step_matches_single_device as check


@pytest.mark.parametrize(("world_size", "name", "precision"), cases(quick=False))
def test_sharded_step_matches_single_device(world_size: int, name: str, precision: str) -> None:
    check(world_size, name, precision)
