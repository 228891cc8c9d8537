"""The rank side of the distributed fuzz test (test_fuzz_ranks.py): build, step,
and report either the result or the error, never raising, so every outcome comes back."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dist

NAMES = ("attn.wq", "attn.wk", "mlp.w1", "norm.bias")


def _params() -> list[tuple[str, nn.Parameter]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    shards = [
        nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=gen), mesh, [Shard(0)]))
        for _ in range(2)
    ]
    plain = [
        nn.Parameter(torch.randn(5, 3, generator=gen)),
        nn.Parameter(torch.randn(4, generator=gen)),
    ]
    return list(zip(NAMES, [*shards, *plain], strict=True))


def _grads(params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=gen)
        p.grad = (
            distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        )


def fuzz_worker(rank: int, world_size: int, spec: list[dict[str, Any]]) -> tuple[str, str]:
    """Run this rank's perturbation ``spec[rank]``: ``("ok", digest of every parameter)``
    or ``("error", the exception's type)``."""
    logging.getLogger("muon_dist").setLevel(logging.CRITICAL)
    mine = spec[rank]
    named = _params()
    params = [p for _, p in named]
    try:
        listed = [(mine.get("rename", {}).get(n, n), p) for n, p in named]
        if mine.get("reverse"):
            listed = listed[::-1]
        opt = muon_dist.Muon(listed, **mine.get("construct", {}))
        _grads(params, 1)
        opt.step()
        for key, value in mine.get("later", {}).items():
            opt.param_groups[0][key] = value
        _grads(params, 2)
        opt.step()
    except Exception as exc:  # every outcome is reported, none raised
        return "error", type(exc).__name__
    values = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in params]
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in values)).hexdigest()
    return "ok", digest
