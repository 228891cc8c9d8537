"""Workers for ``tests/test_dion2_transport.py``: what one Dion2 step sends across ranks."""

from __future__ import annotations

import torch
from repo_paths import comm_bytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import muon_dist


def sent_bytes(rank: int, world_size: int, rule: str, fraction: float) -> tuple[int, int]:
    """Bytes this rank puts into all-to-alls and all-reduces during the third step of a
    model of wide, tall and square matrices under FSDP2 (the first two lay out the plan)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 128, bias=False),  # [128, 256]: wide, rows selected
        nn.Linear(128, 384, bias=False),  # [384, 128]: tall, columns selected
        nn.Linear(384, 256, bias=False),  # wide
        nn.Linear(256, 256, bias=False),  # square
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = muon_dist.Muon(model.named_parameters(), rule=rule, dion2_fraction=fraction)
    x = torch.randn(16, 256)
    counter = comm_bytes()
    sent = counter.SentBytes()
    for step in range(3):
        model(x).square().mean().backward()
        if step == 2:
            with counter.counting() as sent:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    return sent.all_to_all, sent.all_reduce
