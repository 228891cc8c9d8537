"""Dion2: the sharded step equals the single-device reference on every layout (gloo, CPU).

The parity suite's layouts (FSDP2 with uneven and empty shards, a transactional step,
Shard(1), plain replicas, HSDP both modes, TP+FSDP, expert parallel with and without FSDP)
run with every Muon group under Dion2 against ``reference_muon_step(dion2_fraction=...)``,
a plain loop over each matrix's slices. The weights and momenta agree to fp32 rounding only
if every rank selected the same slices as the single-device reference (a different slice
moves a weight by the learning rate and leaves a momentum undecayed): so these runs on 1, 2,
3 and 4 ranks also show the selection independent of the layout. fp32 communication and
Newton–Schulz throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from normuon_cases import layouts, normuon_worker
from parity_cases import case_names, parity_worker

QUICK = {(2, "fsdp"), (3, "fsdp")}


def _mark(world_size: int, name: str) -> tuple[pytest.MarkDecorator, ...]:
    return () if (world_size, name) in QUICK else (pytest.mark.slow,)


@pytest.mark.parametrize(
    ("world_size", "name"),
    [
        pytest.param(w, n, id=f"w{w}-{n}", marks=_mark(w, n))
        for w in (1, 2, 3, 4)
        for n in case_names(w)
    ],
)
def test_parity_layouts_under_dion2(world_size: int, name: str) -> None:
    results = run_distributed(world_size, parity_worker, name, "float32", "float32", "cpu", "dion2")
    for rank, err in enumerate(results):
        assert err["update"] <= 1e-5, f"rank {rank}: {err}"
        assert err["bf16_param"] <= 3e-2, f"rank {rank}: {err}"


@pytest.mark.parametrize(
    ("world_size", "layout"),
    [
        pytest.param(w, n, id=f"w{w}-{n}", marks=_mark(w, n))
        for w in (1, 2, 3, 4)
        for n in layouts(w)
    ],
)
def test_views_parts_and_ties_under_dion2(world_size: int, layout: str) -> None:
    """Heads, row blocks, parts cut on the owner (each part selects on its own), ``[in,
    out]`` storage (the shorter side read in the output orientation), experts, fused experts,
    and an exact tie for the last selected slot; weights and momenta."""
    results = run_distributed(world_size, normuon_worker, layout, "", "dion2")
    for rank, err in enumerate(results):
        assert err <= 1e-5, f"rank {rank} layout {layout}: {err}"


def test_checkpoint_saved_on_two_ranks_resumes_exactly_on_three(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(2, normuon_worker, "save", path, "dion2")
    resumed = run_distributed(3, normuon_worker, "resume", path, "dion2")
    for a, b in zip(uninterrupted[0], resumed[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
