"""Per-head and split views, Magma, cautious decay and QK-clip: sharded equals single-device."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import run_distributed
from feature_cases import feature_cases, feature_worker

# The quick tier keeps the sharded views and QK-clip on two ranks; the rest is the slow tier.
QUICK = {(2, "views_fsdp"), (2, "qk_clip_fsdp")}
CASES = [
    pytest.param(
        world_size,
        name,
        id=f"w{world_size}-{name}",
        marks=() if (world_size, name) in QUICK else pytest.mark.slow,
    )
    for world_size in (1, 2, 4)
    for name in feature_cases(world_size)
]


@pytest.mark.parametrize(("world_size", "name"), CASES)
def test_features_match_single_device(world_size: int, name: str, tmp_path: Path) -> None:
    # The pool's ranks share this machine's file system: the DCP checkpoint goes to tmp_path.
    checkpoint = str(tmp_path / "ckpt")
    for rank, err in enumerate(run_distributed(world_size, feature_worker, name, checkpoint)):
        assert err <= 1e-5, f"rank {rank} case {name}: {err}"
