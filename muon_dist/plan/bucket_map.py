"""Where every piece of a bucket lies, laid out once per plan: the stacks Newton–Schulz runs
on, and each piece's place in them and in the exchange buffers.

Pure plan-time geometry beside :mod:`muon_dist.plan.build`, which decides the blocks and pieces;
a step only takes views by these maps (:func:`region_views`,
:func:`muon_dist.plan.packing.flat_views`), a few per run of like pieces instead of one or two
per piece.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muon_dist.plan.build import BlockPiece, BucketPlan, LocalPiece, Slices, is_whole
from muon_dist.plan.in_place import gathers_in_place, scatters_in_place, with_own
from muon_dist.plan.indices import StackIndex, ViewIndex
from muon_dist.plan.packing import Packing, packing
from muon_dist.plan.recipes import StackRecipe

# A piece of a local shard: (view index in the plan, slices of the local tensor).
LocalSlices = tuple[ViewIndex, Slices]


@dataclass(frozen=True)
class StackSpec:
    """Same-shape, same-schedule owned blocks of a bucket, stacked for one batched kernel
    call; laid out once per plan. ``views`` names each matrix's view (plan position)."""

    index: StackIndex  # unique over the plan: per-stack data is keyed by it
    blocks: tuple[int, ...]
    offsets: tuple[int, ...]  # first matrix of each block in the stack
    shape: tuple[int, int, int]
    recipe: StackRecipe | None  # None in plans built without a step (tests)
    views: tuple[ViewIndex, ...]


def stack_specs(bucket: BucketPlan, first_index: int) -> list[StackSpec]:
    """The stacks of one bucket, numbered from ``first_index``."""
    groups: dict[tuple[int, int, StackRecipe | None], list[int]] = defaultdict(list)
    for index, block in enumerate(bucket.owned):
        groups[(block.rows, block.cols, block.recipe)].append(index)
    stacks: list[StackSpec] = []
    for (rows, cols, recipe), members in groups.items():
        offsets: list[int] = []
        views: list[ViewIndex] = []
        for index in members:
            block = bucket.owned[index]
            offsets.append(len(views))
            views += [block.view] * (block.stop - block.start)
        stacks.append(
            StackSpec(
                StackIndex(first_index + len(stacks)),
                tuple(members),
                tuple(offsets),
                (len(views), rows, cols),
                recipe,
                tuple(views),
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


def stack_places(stacks: Sequence[StackSpec]) -> dict[int, tuple[int, int]]:
    """Each owned block (its index in the bucket) -> its stack's position among
    ``stacks`` and the block's first matrix in that stack."""
    return {
        block: (position, offset)
        for position, stack in enumerate(stacks)
        for block, offset in zip(stack.blocks, stack.offsets, strict=True)
    }


def stack_regions(
    bucket: BucketPlan, stacks: Sequence[StackSpec], pieces: Sequence[tuple[int, Slices]]
) -> tuple[Region, ...]:
    """The regions of ``(owned block, slices in the block)`` pieces, in their order."""
    where = stack_places(stacks)
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


def stack_views(buffer: torch.Tensor, stacks: Sequence[StackSpec]) -> list[torch.Tensor]:
    """The stacks as views of one flat buffer that holds them end to end."""
    sizes = [math.prod(stack.shape) for stack in stacks]
    parts = buffer.split_with_sizes(sizes)
    return [part.view(stack.shape) for part, stack in zip(parts, stacks, strict=True)]


def block_starts(stacks: Sequence[StackSpec]) -> dict[int, int]:
    """Each owned block's first element in the stacks laid end to end."""
    starts: dict[int, int] = {}
    base = 0
    for stack in stacks:
        matrix = stack.shape[1] * stack.shape[2]
        for block, offset in zip(stack.blocks, stack.offsets, strict=True):
            starts[block] = base + offset * matrix
        base += math.prod(stack.shape)
    return starts


@dataclass(frozen=True)
class BucketMap:
    """What a step repeats for one bucket, laid out once per plan: its stacks, the pieces
    of this rank's shards it reads and writes, and where every piece lies in the stacks and
    in the exchange buffers (pieces listed in the plan's order).

    Where the gather's receive buffer is the stacks (``gather_in_place``), this rank's own
    pieces are read into its send buffer and travel as its self split, and nothing is put
    in place; where the scatter's send buffer is the one result stack
    (``scatter_in_place``), its own pieces come back as its self split and are written with
    the received ones (:mod:`muon_dist.plan.in_place`)."""

    stacks: tuple[StackSpec, ...]
    own_reads: tuple[LocalSlices, ...]  # this rank's pieces read straight into its stacks
    own_read_regions: tuple[Region, ...]
    gather_reads: tuple[LocalSlices, ...]  # pieces read into the send buffer
    gather_send: Packing
    gather_recv: Packing
    gather_regions: tuple[Region, ...]  # where received pieces go in the stacks
    gather_in_place: bool  # the receive buffer is the stacks
    own_writes: tuple[LocalSlices, ...]  # this rank's pieces written straight from results
    own_write_regions: tuple[Region, ...]
    scatter_send: Packing
    scatter_regions: tuple[Region, ...]  # which results each holder gets back
    scatter_in_place: bool  # the one result stack is the send buffer
    scatter_recv: Packing
    scatter_writes: tuple[LocalSlices, ...]  # pieces of results received


def bucket_map(
    bucket: BucketPlan,
    first_stack: int,
    world_size: int,
    ranks: Sequence[int],
    rank: int | None = None,
) -> BucketMap:
    """Lay out one bucket; its stacks are numbered from ``first_stack``. Given the calling
    ``rank``, its buffers serve as its stacks wherever the pieces tile them
    (:mod:`muon_dist.plan.in_place`); without (Dion2's selected exchange, tests), every
    buffer is packed."""
    stacks = tuple(stack_specs(bucket, first_stack))
    owned = [
        (index, block.view, local, inside)
        for index, block in enumerate(bucket.owned)
        if block.own_slices is not None
        for local, inside in [block.own_slices]
    ]
    own = tuple((view, local) for _, view, local, _ in owned)
    own_regions = stack_regions(bucket, stacks, [(index, inside) for index, _, _, inside in owned])
    gather_sends, gather_recvs = bucket.gather_sends, bucket.gather_recvs
    scatter_sends, scatter_recvs = bucket.scatter_sends, bucket.scatter_recvs
    gather_in_place = scatter_in_place = False
    if rank is not None:
        # This rank's own pieces as its self split: read from its shard, put in a block.
        sent = [LocalPiece(rank, view, local, _shape(local)) for _, view, local, _ in owned]
        put = [BlockPiece(rank, index, inside, _shape(inside)) for index, _, _, inside in owned]
        starts, numel = block_starts(stacks), sum(math.prod(s.shape) for s in stacks)
        received = with_own(gather_recvs, put)
        if gathers_in_place(bucket, starts, numel, received):
            gather_in_place = True
            gather_sends, gather_recvs = with_own(gather_sends, sent), received
        returned = with_own(scatter_sends, put)
        if scatters_in_place(bucket, len(stacks), starts, numel, returned):
            scatter_in_place = True
            scatter_sends, scatter_recvs = returned, with_own(scatter_recvs, sent)
    return BucketMap(
        stacks,
        () if gather_in_place else own,
        () if gather_in_place else own_regions,
        tuple((p.view, p.slices) for p in gather_sends),
        packing(gather_sends, world_size, ranks),
        packing(gather_recvs, world_size, ranks),
        () if gather_in_place else _regions(bucket, stacks, gather_recvs),
        gather_in_place,
        () if scatter_in_place else own,
        () if scatter_in_place else own_regions,
        packing(scatter_sends, world_size, ranks),
        () if scatter_in_place else _regions(bucket, stacks, scatter_sends),
        scatter_in_place,
        packing(scatter_recvs, world_size, ranks),
        tuple((p.view, p.slices) for p in scatter_recvs),
    )


def _shape(slices: Slices) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in slices)


def _regions(
    bucket: BucketPlan, stacks: Sequence[StackSpec], pieces: Sequence[BlockPiece]
) -> tuple[Region, ...]:
    return stack_regions(bucket, stacks, [(p.block, p.slices) for p in pieces])
