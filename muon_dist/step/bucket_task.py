"""One bucket of the Muon step as a generator task: gather, orthogonalize, scatter, apply.

Where every piece lies, in the stacks and in the exchange buffers, is laid out once per plan
(:mod:`muon_dist.plan.bucket_map`); buffers are fresh every step, so a step takes their views
anew, but a few per run of like pieces instead of one or two per piece.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from muon_dist.comm.exchange import pack, start_exchange
from muon_dist.plan.bucket_map import BucketMap, region_views
from muon_dist.plan.build import BucketPlan
from muon_dist.plan.packing import Packing, flat_views
from muon_dist.runtime.scheduler import Task, TaskBody
from muon_dist.step.bucket_io import BucketTools, Exchanges


def bucket_task(bucket: BucketPlan, where: BucketMap, tools: BucketTools) -> Task:
    """Wrap one bucket's work as a task; it yields once per collective it waits on."""
    return Task(bucket.names, _run_bucket(bucket.communicates, where, tools))


def _run_bucket(communicates: bool, where: BucketMap, tools: BucketTools) -> TaskBody:
    # Buffers are dropped as soon as they are consumed (the collectives keep their own
    # references until they finish), so a bucket waiting on its scatter holds no gather
    # buffers or input stacks while other buckets compute.
    received = None
    if communicates:
        received, work = _start(
            where.gather_send,
            where.gather_recv,
            lambda outs: tools.io.read(where.gather_reads, outs),
            tools.exchanges,
        )
        yield
        work.wait()
    stacks = _assemble(where, tools, received)
    del received
    results = [tools.orthogonalize(t, s) for t, s in zip(stacks, where.stacks, strict=True)]
    del stacks
    tools.io.write(where.own, region_views(results, where.own_regions))
    if communicates:
        received, work = _start(
            where.scatter_send,
            where.scatter_recv,
            lambda outs: _copy_all(outs, region_views(results, where.scatter_regions)),
            tools.exchanges,
        )
        del results
        yield
        work.wait()
        tools.io.write(where.scatter_writes, flat_views(received, where.scatter_recv.runs))


def _start(
    sends: Packing,
    recvs: Packing,
    fill: Callable[[list[torch.Tensor]], object],
    exchanges: Exchanges,
) -> tuple[torch.Tensor, dist.Work]:
    """Pack the pieces this rank sends and start the all-to-all; returns the receive buffer."""
    send = pack(sends, fill, exchanges.dtype, exchanges.device)
    return start_exchange(send, sends.splits, recvs.splits, exchanges.peers)


def _assemble(
    where: BucketMap, tools: BucketTools, received: torch.Tensor | None
) -> list[torch.Tensor]:
    """Newton–Schulz input stacks: this rank's own pieces plus the gathered ones."""
    dtype, device = tools.exchanges.dtype, tools.exchanges.device
    stacks = [torch.empty(s.shape, dtype=dtype, device=device) for s in where.stacks]
    tools.io.read(where.own, region_views(stacks, where.own_regions))
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
