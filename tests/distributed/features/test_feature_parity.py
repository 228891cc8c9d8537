"""Per-head and split views, Magma, cautious decay and QK-clip: sharded equals single-device."""

from __future__ import annotations

from pathlib import Path

import pytest
from _pytest.mark import ParameterSet
from dist_harness import run_distributed
from feature_cases import feature_cases, feature_worker

# The quick tier keeps the sharded views and QK-clip on two ranks; test_feature_parity_slow.py
# runs the rest.
QUICK = {(2, "views_fsdp"), (2, "qk_clip_fsdp")}


def cases(quick: bool) -> list[ParameterSet]:
    """The (world size, feature case) pairs of the quick tier, or of the slow one."""
    return [
        pytest.param(world_size, name, id=f"w{world_size}-{name}")
        for world_size in (1, 2, 4)
        for name in feature_cases(world_size)
        if ((world_size, name) in QUICK) == quick
    ]


@pytest.mark.parametrize(("world_size", "name"), cases(quick=True))
def test_features_match_single_device(world_size: int, name: str, tmp_path: Path) -> None:
    # The pool's ranks share this machine's file system: the DCP checkpoint goes to tmp_path.
    checkpoint = str(tmp_path / "ckpt")
    for rank, err in enumerate(run_distributed(world_size, feature_worker, name, checkpoint)):
        assert err <= 1e-5, f"rank {rank} case {name}: {err}"
