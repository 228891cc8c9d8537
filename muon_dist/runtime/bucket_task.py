"""One bucket of the Muon step as a generator task: gather, orthogonalize, scatter, apply.

Where every piece lies, in the stacks and in the exchange buffers, is laid out once per plan
(:func:`bucket_layout`); buffers are fresh every step, so a step takes their views anew, but
a few per run of like pieces instead of one or two per piece.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from muon_dist.comm import Packing, flat_views, pack, packing, start_exchange
from muon_dist.groups import Peers
from muon_dist.plan import BucketPlan, Slices, is_whole
from muon_dist.runtime.scheduler import Task, TaskBody

# A piece of a local shard: (layout index in the plan, slices of the local tensor).
LocalSlices = tuple[int, Slices]


@dataclass(frozen=True)
class StackLayout:
    """Same-shape, same-schedule owned blocks of a bucket, stacked for one batched kernel
    call; laid out once per plan. ``layouts`` names each matrix's layout (plan position)."""

    index: int  # unique over the plan: the context keys per-stack data by it
    blocks: tuple[int, ...]
    offsets: tuple[int, ...]  # first matrix of each block in the stack
    shape: tuple[int, int, int]
    ns_key: Hashable
    layouts: tuple[int, ...]


def stack_layouts(bucket: BucketPlan, first_index: int) -> list[StackLayout]:
    """The stacks of one bucket, numbered from ``first_index``."""
    groups: dict[tuple[int, int, Hashable], list[int]] = defaultdict(list)
    for index, block in enumerate(bucket.owned):
        groups[(block.rows, block.cols, block.ns_key)].append(index)
    stacks: list[StackLayout] = []
    for (rows, cols, ns_key), members in groups.items():
        offsets: list[int] = []
        layouts: list[int] = []
        for index in members:
            block = bucket.owned[index]
            offsets.append(len(layouts))
            layouts += [block.param] * (block.stop - block.start)
        stacks.append(
            StackLayout(
                first_index + len(stacks),
                tuple(members),
                tuple(offsets),
                (len(layouts), rows, cols),
                ns_key,
                tuple(layouts),
            )
        )
    return stacks


@dataclass(frozen=True)
class Region:
    """The pieces of ``count`` consecutive blocks of one stack that share a shape and are cut
    alike: one chain of view ops takes all of them. ``slices`` is None for whole blocks."""

    stack: int  # position among the bucket's stacks
    start: int  # first matrix in the stack
    count: int
    matrices: int  # per block
    shape: tuple[int, ...]  # of each block
    slices: Slices | None  # of each piece inside its block


def stack_regions(
    bucket: BucketPlan, stacks: Sequence[StackLayout], pieces: Sequence[tuple[int, Slices]]
) -> tuple[Region, ...]:
    """The regions of ``(owned block, slices in the block)`` pieces, in their order."""
    where = {
        block: (position, offset)
        for position, stack in enumerate(stacks)
        for block, offset in zip(stack.blocks, stack.offsets, strict=True)
    }
    out: list[Region] = []
    for index, slices in pieces:
        block = bucket.owned[index]
        stack, start = where[index]
        matrices = block.stop - block.start
        cut = None if is_whole(slices, block.shape) else slices
        last = out[-1] if out else None
        if last is not None and (
            last.stack,
            last.start + last.count * last.matrices,
            last.matrices,
            last.shape,
            last.slices,
        ) == (stack, start, matrices, block.shape, cut):
            out[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            out.append(Region(stack, start, 1, matrices, block.shape, cut))
    return tuple(out)


def region_views(stacks: Sequence[torch.Tensor], regions: Sequence[Region]) -> list[torch.Tensor]:
    """Each piece's view of the stacks, shaped like the piece, in the regions' order."""
    views: list[torch.Tensor] = []
    for region in regions:
        part = stacks[region.stack].narrow(0, region.start, region.count * region.matrices)
        if region.count == 1:
            part = part.view(region.shape)
            views.append(part if region.slices is None else part[region.slices])
            continue
        part = part.view(region.count, *region.shape)
        if region.slices is not None:
            every_block = (slice(None), *region.slices)
            part = part[every_block]
        views.extend(part.unbind(0))
    return views


@dataclass(frozen=True)
class BucketLayout:
    """What a step repeats for one bucket, laid out once per plan: its stacks, the pieces
    of this rank's shards it reads and writes, and where every piece lies in the stacks and
    in the exchange buffers (pieces listed in the plan's order)."""

    stacks: tuple[StackLayout, ...]
    own: tuple[LocalSlices, ...]  # this rank's pieces of the blocks it owns
    own_regions: tuple[Region, ...]
    gather_reads: tuple[LocalSlices, ...]  # pieces sent to their owners
    gather_send: Packing
    gather_recv: Packing
    gather_regions: tuple[Region, ...]  # where received pieces go in the stacks
    scatter_send: Packing
    scatter_regions: tuple[Region, ...]  # which results each holder gets back
    scatter_recv: Packing
    scatter_writes: tuple[LocalSlices, ...]  # pieces of results received


def bucket_layout(
    bucket: BucketPlan, first_stack: int, world_size: int, peers: Peers
) -> BucketLayout:
    """Lay out one bucket; its stacks are numbered from ``first_stack``."""
    stacks = tuple(stack_layouts(bucket, first_stack))
    owned = [
        (block.param, block.own_slices, index)
        for index, block in enumerate(bucket.owned)
        if block.own_slices is not None
    ]
    return BucketLayout(
        stacks,
        tuple((param, local) for param, (local, _), _ in owned),
        stack_regions(bucket, stacks, [(index, inside) for _, (_, inside), index in owned]),
        tuple((p.param, p.slices) for p in bucket.gather_sends),
        packing(bucket.gather_sends, world_size, peers),
        packing(bucket.gather_recvs, world_size, peers),
        stack_regions(bucket, stacks, [(p.block, p.slices) for p in bucket.gather_recvs]),
        packing(bucket.scatter_sends, world_size, peers),
        stack_regions(bucket, stacks, [(p.block, p.slices) for p in bucket.scatter_sends]),
        packing(bucket.scatter_recvs, world_size, peers),
        tuple((p.param, p.slices) for p in bucket.scatter_recvs),
    )


class StepContext(Protocol):
    """What a bucket task needs from the optimizer for one step."""

    peers: Peers  # the ranks this rank's all-to-alls run among
    comm_dtype: torch.dtype
    device: torch.device

    def read_updates(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        """Write the Newton–Schulz input of each piece of a local shard into its ``out``,
        casting to its dtype (all pieces of one phase at once). ``pieces`` is one of a
        layout's tuples, the same object every step."""
        ...

    def orthogonalize(self, stack: torch.Tensor, layout: StackLayout) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack, recording on the device whether
        the result is finite."""
        ...

    def apply(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        """Add each piece's scaled orthogonalized update to that piece of a local shard (all
        pieces of one phase at once, so they can share launches); ``pieces`` as above."""
        ...


def bucket_task(bucket: BucketPlan, layout: BucketLayout, ctx: StepContext) -> Task:
    """Wrap one bucket's work as a task; it yields once per collective it waits on."""
    return Task(bucket.names, _run_bucket(bucket.communicates, layout, ctx))


def _run_bucket(communicates: bool, layout: BucketLayout, ctx: StepContext) -> TaskBody:
    # Buffers are dropped as soon as they are consumed (the collectives keep their own
    # references until they finish), so a bucket waiting on its scatter holds no gather
    # buffers or input stacks while other buckets compute.
    received = None
    if communicates:
        received, work = _start(
            layout.gather_send,
            layout.gather_recv,
            lambda outs: ctx.read_updates(layout.gather_reads, outs),
            ctx,
        )
        yield
        work.wait()
    stacks = _assemble(layout, ctx, received)
    del received
    results = [ctx.orthogonalize(t, s) for t, s in zip(stacks, layout.stacks, strict=True)]
    del stacks
    ctx.apply(layout.own, region_views(results, layout.own_regions))
    if communicates:
        received, work = _start(
            layout.scatter_send,
            layout.scatter_recv,
            lambda outs: _copy_all(outs, region_views(results, layout.scatter_regions)),
            ctx,
        )
        del results
        yield
        work.wait()
        ctx.apply(layout.scatter_writes, flat_views(received, layout.scatter_recv.runs))


def _start(
    sends: Packing,
    recvs: Packing,
    fill: Callable[[list[torch.Tensor]], object],
    ctx: StepContext,
) -> tuple[torch.Tensor, dist.Work]:
    """Pack the pieces this rank sends and start the all-to-all; returns the receive buffer."""
    send = pack(sends, fill, ctx.comm_dtype, ctx.device)
    return start_exchange(send, sends, recvs, ctx.peers)


def _assemble(
    layout: BucketLayout, ctx: StepContext, received: torch.Tensor | None
) -> list[torch.Tensor]:
    """Newton–Schulz input stacks: this rank's own pieces plus the gathered ones."""
    stacks = [torch.empty(s.shape, dtype=ctx.comm_dtype, device=ctx.device) for s in layout.stacks]
    ctx.read_updates(layout.own, region_views(stacks, layout.own_regions))
    if received is not None:
        _copy_all(
            region_views(stacks, layout.gather_regions),
            flat_views(received, layout.gather_recv.runs),
        )
    return stacks


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, in one foreach launch where it can."""
    if targets:
        torch._foreach_copy_(targets, sources)
