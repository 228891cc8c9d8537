"""The sharded step equals single-device Muon on every supported layout (gloo, CPU).

One test per (world size, layout, communication dtype); each world size's cases run in one
process group that stays up for the session (dist_harness).
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from parity_cases import case_names, parity_worker

# The quick tier keeps one sharded layout on two ranks; the rest is the slow tier.
QUICK = {(2, "fsdp", "float32")}
CASES = [
    pytest.param(
        world_size,
        name,
        comm_dtype,
        id=f"w{world_size}-{name}-{comm_dtype}",
        marks=() if (world_size, name, comm_dtype) in QUICK else pytest.mark.slow,
    )
    for world_size in (1, 2, 3, 4)
    for name in case_names(world_size)
    for comm_dtype in ("float32", "bfloat16")
]


@pytest.mark.parametrize(("world_size", "name", "comm_dtype"), CASES)
def test_sharded_step_matches_single_device(world_size: int, name: str, comm_dtype: str) -> None:
    tolerance = 1e-5 if comm_dtype == "float32" else 2e-2
    for rank, err in enumerate(run_distributed(world_size, parity_worker, name, comm_dtype)):
        assert err["update"] <= tolerance, f"rank {rank}: {err}"
        # A bf16 parameter rounds at each decay, momentum and update: a few ulps of 2^-8.
        assert err["bf16_param"] <= 3e-2, f"rank {rank}: {err}"
