"""Bad distributed set-ups, run on every rank: each must raise a clear error, never hang."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import muon_dist


def _partial_placement() -> None:
    mesh = init_device_mesh("cpu", (2,))
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, [Partial()], run_check=False))
    muon_dist.Muon([{"params": [p], "param_names": ["attn.wq.weight"], "algorithm": "muon"}])


def _strided_shard() -> None:
    mesh = init_device_mesh("cpu", (2,))
    placement = _StridedShard(0, split_factor=2)
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, [placement], run_check=False))
    muon_dist.Muon([{"params": [p], "param_names": ["mlp.w1.weight"], "algorithm": "muon"}])


def _ranks_disagree() -> None:
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    shape = (8, 6) if rank == 0 else (8, 7)
    p = nn.Parameter(
        DTensor.from_local(torch.randn(4, shape[1]), mesh, [Shard(0)], run_check=False)
    )
    muon_dist.Muon([{"params": [p], "param_names": ["mlp.w2.weight"], "algorithm": "muon"}])


CASES: dict[str, tuple[Callable[[], None], type[Exception], str]] = {
    "partial": (_partial_placement, ValueError, r"attn\.wq\.weight has placements \(Partial"),
    "strided": (_strided_shard, ValueError, r"mlp\.w1\.weight has placements"),
    "disagree": (
        _ranks_disagree,
        RuntimeError,
        r"ranks disagree .*\n  parameter 0: ranks \[0\]: 'mlp\.w2\.weight' \(8, 6\).*"
        r"ranks \[1\]: 'mlp\.w2\.weight' \(8, 7\)",
    ),
}


def error_worker(rank: int, world_size: int, name: str) -> str:
    """Build bad set-up ``name``; it must raise its error with its message on this rank."""
    build, error, pattern = CASES[name]
    with pytest.raises(error, match=pattern):
        build()
    return name
