"""NorMuon: the sharded step equals the single-device reference on every layout (gloo, CPU),
and a checkpoint saved on 2 ranks resumes exactly on 3.

Two suites: the parity suite's layouts (FSDP2 with uneven and empty shards, a transactional
step, Shard(1), plain replicas, HSDP both modes, TP+FSDP, expert parallel with and without
FSDP) with every Muon group under NorMuon, and NorMuon's own cases for the matrices a
parameter is cut into (heads, row blocks, parts cut on the owner, ``[in, out]`` storage,
experts, fused experts). fp32 communication and Newton–Schulz throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from normuon_cases import layouts, normuon_worker
from parity_cases import case_names, parity_worker

QUICK = {(2, "fsdp")}


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
def test_parity_layouts_under_normuon(world_size: int, name: str) -> None:
    results = run_distributed(
        world_size, parity_worker, name, "float32", "float32", "cpu", "normuon"
    )
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
def test_views_and_parts_under_normuon(world_size: int, layout: str) -> None:
    for rank, err in enumerate(run_distributed(world_size, normuon_worker, layout)):
        assert err <= 1e-5, f"rank {rank} layout {layout}: {err}"


def test_checkpoint_saved_on_two_ranks_resumes_exactly_on_three(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(2, normuon_worker, "save", path)
    resumed = run_distributed(3, normuon_worker, "resume", path)
    for states in (uninterrupted, resumed):
        for other in states[1:]:  # full values and replicated moments agree across ranks
            for a, b in zip(states[0], other, strict=True):
                assert torch.equal(a, b)
    for a, b in zip(uninterrupted[0], resumed[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
