"""Dion2 moves only the slices it selected: the bytes a rank sends in a step (gloo, CPU).

The issue's target is at most 0.3x Muon's bytes at ``dion2_fraction=0.25``: a quarter of
each matrix's slices travel to the owner and back, plus one all-reduce of the slice norms
(one float64 per slice) and the step's agreement, which Muon sends too. The byte count runs
in the slow tier (test_dion2_transport_slow.py).
"""

from __future__ import annotations

import pytest
from dion2_transport_cases import mixed_rules_error, sent_bytes
from dist_harness import run_distributed


def dion2_sends_a_quarter_of_muons_bytes(world_size: int) -> None:
    muon = run_distributed(world_size, sent_bytes, "muon", 0.25)
    dion2 = run_distributed(world_size, sent_bytes, "dion2", 0.25)
    everything = run_distributed(world_size, sent_bytes, "dion2", 1.0)
    for rank in range(world_size):
        muon_total, dion2_total = sum(muon[rank]), sum(dion2[rank])
        assert muon[rank][0] > 0
        assert dion2_total <= 0.3 * muon_total, (rank, dion2[rank], muon[rank])
        # Every slice selected: the same elements travel as under Muon.
        assert everything[rank][0] == muon[rank][0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_dion2_groups_share_a_bucket(world_size: int) -> None:
    for rank, err in enumerate(run_distributed(world_size, mixed_rules_error)):
        assert err <= 1e-5, f"rank {rank}: {err}"
