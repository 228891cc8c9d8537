"""Per-head and split views, Magma, cautious decay and QK-clip: sharded equals single-device."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import run_distributed
from feature_cases import feature_worker


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_features_match_single_device(world_size: int, tmp_path: Path) -> None:
    # One world size also saves and resumes Magma state through DCP.
    checkpoint = str(tmp_path / "ckpt") if world_size == 2 else None
    for rank, per_case in enumerate(run_distributed(world_size, feature_worker, checkpoint)):
        for case, err in per_case.items():
            assert err <= 1e-5, f"rank {rank} case {case}: {err}"
