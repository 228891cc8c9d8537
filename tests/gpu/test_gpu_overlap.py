"""``overlap="backward"`` on GPUs with NCCL (`pytest -m gpu`): an unedited step is not
redone, and its result is the plain step's, bitwise in fp32.

CPU tests cannot catch a redo that only CUDA's kernels cause: there the norms a hook records
and those ``step()`` compares came from different reductions, differed in their last bits,
and every overlapped step ran its Muon phase twice.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from dist_harness import pool
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import muon_dist

WIDTHS = (96, 160, 64, 128)
STEPS = 4


def _run(overlap: str, rank: int) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    layers = [nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(WIDTHS)]
    model = nn.Sequential(*layers).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = muon_dist.Muon(
        muon_dist.param_groups(model),
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        bucket_bytes=64,
        overlap=overlap,
    )
    generator = torch.Generator(device=device).manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(8, WIDTHS[0], device=device, generator=generator)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = [p.to_local().clone() if isinstance(p, DTensor) else p for p in model.parameters()]
    early = opt.runner.early
    return params, 0 if early is None else early.redone


def overlap_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    plain, _ = _run("none", rank)
    overlapped, redone = _run("backward", rank)
    equal = all(torch.equal(a, b) for a, b in zip(plain, overlapped, strict=True))
    return {"equal": equal, "redone": redone}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unedited_overlapped_steps_are_not_redone(world_size: int) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    for rank, out in enumerate(pool(world_size, "nccl").run(overlap_worker)):
        assert out["redone"] == 0, f"rank {rank}: {out['redone']} of {STEPS} steps redone"
        assert out["equal"], f"rank {rank}: the overlapped run differs from the plain one"
