"""The sharded step equals single-device Muon on every supported layout (gloo, CPU)."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from parity_cases import parity_worker


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("comm_dtype", ["float32", "bfloat16"])
def test_sharded_step_matches_single_device(world_size: int, comm_dtype: str) -> None:
    results = run_distributed(world_size, parity_worker, comm_dtype)
    tolerance = 1e-5 if comm_dtype == "float32" else 2e-2
    for rank, per_case in enumerate(results):
        for case, err in per_case.items():
            assert err["update"] <= tolerance, f"rank {rank} case {case}: {err}"
            # A bf16 parameter rounds at each decay, momentum and update: a few ulps of 2^-8.
            assert err["bf16_param"] <= 3e-2, f"rank {rank} case {case}: {err}"
