"""Dion2 moves only the slices it selected: the bytes a rank sends in a step (gloo, CPU;
test_dion2_transport_slow.py), and shares buckets with Muon.

The issue's target is at most 0.3x Muon's bytes at ``dion2_fraction=0.25``: a quarter of
each matrix's slices travel to the owner and back, plus one all-reduce of the slice norms
(one float64 per slice) and the step's agreement, which Muon sends too.
"""

from __future__ import annotations

import pytest
from dion2_transport_cases import mixed_rules_error
from dist_harness import run_distributed


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_dion2_groups_share_a_bucket(world_size: int) -> None:
    for rank, err in enumerate(run_distributed(world_size, mixed_rules_error)):
        assert err <= 1e-5, f"rank {rank}: {err}"
