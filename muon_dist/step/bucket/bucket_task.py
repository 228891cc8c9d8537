"""One bucket of the Muon step as a generator task: gather, orthogonalize, scatter, write.

One skeleton for every bucket: the transport (:class:`muon_dist.comm.exchange.BucketExchange`)
is the plain packed exchange, or one a rule's wing brings (Dion2's moves only the chosen
slices, :class:`muon_dist.comm.dion2_exchange.SelectedExchange`). Where every piece lies, in the
stacks and in the exchange buffers, is laid out once per plan
(:mod:`muon_dist.plan.bucket_map`); buffers are fresh every step, so a step takes their views
anew, but a few per run of like pieces instead of one or two per piece.
"""

from __future__ import annotations

import torch

from muon_dist.comm.exchange import BucketExchange, PackedExchange
from muon_dist.plan.bucket_map import BucketMap, region_views
from muon_dist.plan.build import BucketPlan
from muon_dist.runtime.scheduler import Task, TaskBody
from muon_dist.step.bucket.bucket_io import BucketTools


def bucket_task(
    bucket: BucketPlan, where: BucketMap, tools: BucketTools, exchange: BucketExchange | None
) -> Task:
    """Wrap one bucket's work as a task, on ``exchange`` (None: the packed exchange); it
    yields once per collective it waits on."""
    if exchange is None:
        exchange = PackedExchange(where, bucket.communicates, tools.exchanges)
    return Task(bucket.names, run_bucket(where, tools, exchange))


def run_bucket(where: BucketMap, tools: BucketTools, exchange: BucketExchange) -> TaskBody:
    """The skeleton of every bucket task. Buffers are dropped as soon as they are consumed
    (the collectives keep their own references until they finish), so a bucket waiting on
    its scatter holds no gather buffers or input stacks while other buckets compute."""

    def own(stacks: list[torch.Tensor]) -> None:
        tools.io.read(where.own_reads, region_views(stacks, where.own_read_regions))

    stacks = yield from exchange.gather(lambda outs: tools.io.read(where.gather_reads, outs), own)
    results = tools.orthogonalize.stacks(stacks, where.stacks)
    del stacks
    tools.io.write(where.own_writes, region_views(results, where.own_write_regions))
    updates = yield from exchange.scatter(results)
    if updates is not None:
        tools.io.write(where.scatter_writes, updates)
