"""Workers for ``test_dion2_transport.py``: what one Dion2 step sends across ranks,
and Muon and Dion2 groups sharing its buckets."""

from __future__ import annotations

import torch
from reference_muon import reference_muon_step
from repo_paths import comm_bytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

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


def mixed_rules_error(rank: int, world_size: int) -> float:
    """Two groups in one bucket, Muon's and Dion2's, under FSDP2 on ``world_size`` ranks
    (fp32): the largest relative error of the weights after three steps against the
    single-matrix references (Muon's pieces travel whole through Dion2's bucket)."""
    torch.manual_seed(0)
    shapes = [(24, 40), (40, 24), (32, 32)]
    fulls = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    mesh = init_device_mesh("cpu", (world_size,))
    params = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
    rules = ["muon", "dion2", "dion2"]
    opt = muon_dist.Muon(
        [
            {"params": [p], "param_names": [f"w{i}"], "algorithm": "muon", "rule": rule}
            for i, (p, rule) in enumerate(zip(params, rules, strict=True))
        ],
        lr=0.02,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
    )
    refs = [f.clone() for f in fulls]
    momenta = [torch.zeros_like(f) for f in fulls]
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
        for ref, g, m, rule in zip(refs, step, momenta, rules, strict=True):
            reference_muon_step(
                ref,
                g,
                m,
                lr=0.02,
                ns_dtype=torch.float32,
                dion2_fraction=0.25 if rule == "dion2" else None,
            )
    muon = opt.runner.muon
    assert muon is not None and (world_size == 1 or any(w.packed for w in muon.wings.values()))
    return max(
        float((p.full_tensor() - ref).norm() / ref.norm())
        for p, ref in zip(params, refs, strict=True)
    )
