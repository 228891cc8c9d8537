"""One bucket of the Muon step as a generator task: gather, orthogonalize, scatter, apply."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from muon_dist.comm import PieceT, pack, start_exchange, unpack
from muon_dist.groups import Peers
from muon_dist.plan import BlockPiece, BucketPlan, LocalPiece
from muon_dist.runtime.scheduler import Task, TaskBody


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


class StepContext(Protocol):
    """What a bucket task needs from the optimizer for one step."""

    world_size: int
    peers: Peers  # the ranks this rank's all-to-alls run among
    comm_dtype: torch.dtype
    device: torch.device

    def read_updates(self, pieces: Sequence[tuple[int, tuple[slice, ...], torch.Tensor]]) -> None:
        """Write the Newton–Schulz input of each ``(param, slices, out)`` piece of a local
        shard into ``out``, casting to its dtype (all pieces of one phase at once)."""
        ...

    def orthogonalize(self, stack: torch.Tensor, layout: StackLayout) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack, recording on the device whether
        the result is finite."""
        ...

    def apply(self, pieces: Sequence[tuple[int, tuple[slice, ...], torch.Tensor]]) -> None:
        """Add each ``(param, slices, ortho)``'s scaled orthogonalized update to that piece
        of a local shard (all pieces of one phase at once, so they can share launches)."""
        ...


def _block_views(
    bucket: BucketPlan, layouts: Sequence[StackLayout], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each owned block's region of its stack, shaped like the block's box."""
    views: list[torch.Tensor] = [torch.empty(0)] * len(bucket.owned)
    for layout, tensor in zip(layouts, tensors, strict=True):
        blocks = [bucket.owned[index] for index in layout.blocks]
        parts = tensor.split_with_sizes([block.stop - block.start for block in blocks])
        for index, block, part in zip(layout.blocks, blocks, parts, strict=True):
            views[index] = part.view(block.shape)
    return views


def bucket_task(bucket: BucketPlan, layouts: Sequence[StackLayout], ctx: StepContext) -> Task:
    """Wrap one bucket's work as a task; it yields once per collective it waits on."""
    return Task(bucket.names, _run_bucket(bucket, layouts, ctx))


def _run_bucket(bucket: BucketPlan, layouts: Sequence[StackLayout], ctx: StepContext) -> TaskBody:
    # Buffers are dropped as soon as they are consumed (the collectives keep their own
    # references until they finish), so a bucket waiting on its scatter holds no gather
    # buffers or input stacks while other buckets compute.
    received = None
    if bucket.communicates:
        received, work = _start(
            bucket.gather_sends,
            bucket.gather_recvs,
            lambda items: ctx.read_updates([(p.param, p.slices, out) for p, out in items]),
            ctx,
        )
        yield
        work.wait()
    stacks = _assemble(bucket, layouts, ctx, received)
    del received
    stacks = [ctx.orthogonalize(t, layout) for t, layout in zip(stacks, layouts, strict=True)]
    results = _block_views(bucket, layouts, stacks)
    del stacks
    ctx.apply(
        [
            (block.param, block.own_slices[0], result[block.own_slices[1]])
            for block, result in zip(bucket.owned, results, strict=True)
            if block.own_slices is not None
        ]
    )
    if bucket.communicates:
        received, work = _start(
            bucket.scatter_sends,
            bucket.scatter_recvs,
            lambda items: _copy_all(
                [out for _, out in items], [results[p.block][p.slices] for p, _ in items]
            ),
            ctx,
        )
        del results
        yield
        work.wait()
        ctx.apply(
            [
                (piece.param, piece.slices, chunk)
                for piece, chunk in unpack(received, bucket.scatter_recvs)
            ]
        )


def _start(
    sends: Sequence[PieceT],
    recvs: Sequence[LocalPiece] | Sequence[BlockPiece],
    fill: Callable[[list[tuple[PieceT, torch.Tensor]]], object],
    ctx: StepContext,
) -> tuple[torch.Tensor, dist.Work]:
    """Pack the pieces this rank sends and start the all-to-all; returns the receive buffer."""
    send = pack(sends, fill, ctx.comm_dtype, ctx.device)
    return start_exchange(send, sends, recvs, ctx.world_size, ctx.peers)


def _assemble(
    bucket: BucketPlan,
    layouts: Sequence[StackLayout],
    ctx: StepContext,
    received: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Newton–Schulz input stacks: this rank's own pieces plus the gathered ones."""
    stacks = [torch.empty(lay.shape, dtype=ctx.comm_dtype, device=ctx.device) for lay in layouts]
    inputs = _block_views(bucket, layouts, stacks)
    ctx.read_updates(
        [
            (block.param, block.own_slices[0], view[block.own_slices[1]])
            for block, view in zip(bucket.owned, inputs, strict=True)
            if block.own_slices is not None
        ]
    )
    if received is not None:
        pieces = list(unpack(received, bucket.gather_recvs))
        _copy_all([inputs[p.block][p.slices] for p, _ in pieces], [chunk for _, chunk in pieces])
    return stacks


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, in one foreach launch where it can."""
    if targets:
        torch._foreach_copy_(targets, sources)
