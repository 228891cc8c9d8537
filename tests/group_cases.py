"""Collectives on the right ranks: every collective of an optimizer runs among the ranks
that hold its parameters (pipeline stages), and HSDP's redundant all-to-alls among a shard
group only. Each case also checks parity with the single-device reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from parity_cases import Case, P, dense_params, run_case
from torch.distributed.tensor import Replicate, Shard

RECORDED = ("all_to_all_single", "all_reduce", "all_gather_object")


@contextmanager
def recording(calls: list[tuple[str, tuple[int, ...]]]) -> Iterator[None]:
    """Record the global ranks of every collective in ``RECORDED`` issued inside."""
    originals: dict[str, Callable[..., Any]] = {name: getattr(dist, name) for name in RECORDED}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            calls.append((name, tuple(sorted(ranks))))
            return originals[name](*args, group=group, **kwargs)

        return call

    for name in RECORDED:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _stage_params(stage: int) -> list[P]:
    """Different parameters per stage, so collectives issued on the world would not match."""
    if stage == 0:
        return dense_params()
    return [P((40, 24)), P((4, 24, 16), kind="experts"), P((24,), kind="adamw")]


def pipeline_worker(rank: int, world_size: int, comm_dtype: str) -> dict[str, Any]:
    """Two pipeline stages on ranks {0, 1} and {2, 3} (a ("pp", "dp") mesh), each with its
    own FSDP2 model part and its own Muon."""
    stage = rank // 2
    case = Case(
        f"stage{stage}",
        _stage_params(stage),
        (2, world_size // 2),
        fsdp=True,
        mesh_names=("pp", "dp"),
        submesh="dp",
    )
    calls: list[tuple[str, tuple[int, ...]]] = []
    with recording(calls):
        errors = run_case(case, getattr(torch, comm_dtype), torch.bfloat16, world_size)
    return {"errors": errors, "calls": calls, "stage_ranks": (2 * stage, 2 * stage + 1)}


def hsdp_worker(rank: int, world_size: int, replica_mode: str) -> dict[str, Any]:
    """HSDP on a (replicate 2, shard 2) mesh."""
    case = Case(
        f"hsdp_{replica_mode}",
        dense_params(),
        (2, world_size // 2),
        placements=(Replicate(), Shard(0)),
        replica_mode=replica_mode,
    )
    calls: list[tuple[str, tuple[int, ...]]] = []
    with recording(calls):
        errors = run_case(case, torch.float32, torch.bfloat16, world_size)
    shard_group = tuple(r for r in range(world_size) if r // 2 == rank // 2)
    return {"errors": errors, "calls": calls, "shard_group": shard_group}
