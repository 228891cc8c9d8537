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

import pytest
from dist_harness import run_distributed
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
