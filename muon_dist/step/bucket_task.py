"""One bucket of the Muon step as a generator task: gather, orthogonalize, scatter, apply.

Where every piece lies, in the stacks and in the exchange buffers, is laid out once per plan
(:mod:`muon_dist.plan.bucket_map`); buffers are fresh every step, so a step takes their views
anew, but a few per run of like pieces instead of one or two per piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from muon_dist.dist.exchange import pack, start_exchange
from muon_dist.dist.groups import Peers
from muon_dist.plan.bucket_map import BucketMap, LocalSlices, StackSpec, region_views
from muon_dist.plan.build import BucketPlan
from muon_dist.plan.packing import Packing, flat_views
from muon_dist.runtime.scheduler import Task, TaskBody


class StepContext(Protocol):
    """What a bucket task needs from the optimizer for one step."""

    peers: Peers  # the ranks this rank's all-to-alls run among
    comm_dtype: torch.dtype
    device: torch.device

    def read_updates(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        """Write the Newton–Schulz input of each piece of a local shard into its ``out``,
        casting to its dtype (all pieces of one phase at once). ``pieces`` is one of a
        bucket map's tuples, the same object every step."""
        ...

    def orthogonalize(self, stack: torch.Tensor, spec: StackSpec) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack, recording on the device whether
        the result is finite."""
        ...

    def apply(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        """Add each piece's scaled orthogonalized update to that piece of a local shard (all
        pieces of one phase at once, so they can share launches); ``pieces`` as above."""
        ...


def bucket_task(bucket: BucketPlan, where: BucketMap, ctx: StepContext) -> Task:
    """Wrap one bucket's work as a task; it yields once per collective it waits on."""
    return Task(bucket.names, _run_bucket(bucket.communicates, where, ctx))


def _run_bucket(communicates: bool, where: BucketMap, ctx: StepContext) -> TaskBody:
    # Buffers are dropped as soon as they are consumed (the collectives keep their own
    # references until they finish), so a bucket waiting on its scatter holds no gather
    # buffers or input stacks while other buckets compute.
    received = None
    if communicates:
        received, work = _start(
            where.gather_send,
            where.gather_recv,
            lambda outs: ctx.read_updates(where.gather_reads, outs),
            ctx,
        )
        yield
        work.wait()
    stacks = _assemble(where, ctx, received)
    del received
    results = [ctx.orthogonalize(t, s) for t, s in zip(stacks, where.stacks, strict=True)]
    del stacks
    ctx.apply(where.own, region_views(results, where.own_regions))
    if communicates:
        received, work = _start(
            where.scatter_send,
            where.scatter_recv,
            lambda outs: _copy_all(outs, region_views(results, where.scatter_regions)),
            ctx,
        )
        del results
        yield
        work.wait()
        ctx.apply(where.scatter_writes, flat_views(received, where.scatter_recv.runs))


def _start(
    sends: Packing,
    recvs: Packing,
    fill: Callable[[list[torch.Tensor]], object],
    ctx: StepContext,
) -> tuple[torch.Tensor, dist.Work]:
    """Pack the pieces this rank sends and start the all-to-all; returns the receive buffer."""
    send = pack(sends, fill, ctx.comm_dtype, ctx.device)
    return start_exchange(send, sends.splits, recvs.splits, ctx.peers)


def _assemble(
    where: BucketMap, ctx: StepContext, received: torch.Tensor | None
) -> list[torch.Tensor]:
    """Newton–Schulz input stacks: this rank's own pieces plus the gathered ones."""
    stacks = [torch.empty(s.shape, dtype=ctx.comm_dtype, device=ctx.device) for s in where.stacks]
    ctx.read_updates(where.own, region_views(stacks, where.own_regions))
    if received is not None:
        _copy_all(
            region_views(stacks, where.gather_regions),
            flat_views(received, where.gather_recv.runs),
        )
    return stacks


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, in one foreach launch where it can."""
    if targets:
        torch._foreach_copy_(targets, sources)
