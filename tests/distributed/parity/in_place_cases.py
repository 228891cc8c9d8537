"""The exchange's buffers used as stacks (plan/in_place.py) against the packed exchange: the
same parity case run with each, compared bitwise, since a copy is exact.

Buckets of about one matrix per owner (``bucket_bytes``) put one ``Shard(0)`` matrix in most
stacks, the shape that goes in place; the cases' uneven and empty shards, stacks of several
matrices, replicas and column shards stay packed beside them in the same steps.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch
from packed_maps import packed_only
from parity_cases import PRECISIONS, cases_for, full_value, train_case
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 64


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def in_place_worker(
    rank: int, world_size: int, name: str, precision: str, rule: str = "muon"
) -> dict[str, Any]:
    """Case ``name`` under ``rule`` trained in place where the plan allows and all packed:
    whether the parameters (gathered) and optimizer state (local) came out bitwise equal,
    and how many buckets of this rank took each in-place direction."""
    (case,) = [c for c in cases_for(world_size) if c.name == name]
    case = dataclasses.replace(case, extra={**case.extra, "bucket_bytes": BUCKET_BYTES})
    comm, ns = (getattr(torch, dtype) for dtype in PRECISIONS[precision])
    snapshots = []
    counts: dict[str, int] = {}
    for packed in (False, True):
        with packed_only() if packed else nullcontext():
            trained = train_case(case, comm, ns, world_size, rule=rule)
        tensors = [full_value(p).clone() for p in trained.params]
        for p in trained.params:
            tensors += [
                _local(v).clone() for v in trained.opt.state[p].values() if torch.is_tensor(v)
            ]
        snapshots.append(tensors)
        if not packed:
            maps = trained.opt.runner.muon.maps
            counts = {
                "gathers": sum(m.gather_in_place for m in maps),
                "scatters": sum(m.scatter_in_place for m in maps),
            }
    a, b = snapshots
    equal = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return {"equal": equal, **counts}
