"""The slow tier of test_reliability.py: edge shapes on 3 and 4 ranks, and a long run."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from parity_cases import PRECISIONS, parity_violations
from reliability_cases import edge_worker, long_run_worker


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("world_size", [3, 4])
def test_edge_shapes_match_single_device(world_size: int, precision: str) -> None:
    for err in run_distributed(world_size, edge_worker, precision):
        assert not parity_violations(err, precision), err


def test_two_hundred_steps_on_four_ranks() -> None:
    for result in run_distributed(4, long_run_worker, 200, timeout=600):
        assert result["sharded"] <= 1e-5 and result["replicated"] <= 1e-5, result
