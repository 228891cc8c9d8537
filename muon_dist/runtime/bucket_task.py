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
from muon_dist.plan import BlockPiece, BucketPlan, LocalPiece, OwnedBlock
from muon_dist.runtime.scheduler import Task, TaskBody


class StepContext(Protocol):
    """What a bucket task needs from the optimizer for one step."""

    world_size: int
    peers: Peers  # the ranks this rank's all-to-alls run among
    comm_dtype: torch.dtype
    device: torch.device

    def read_update(self, param: int, slices: tuple[slice, ...], out: torch.Tensor) -> None:
        """Write the Newton–Schulz input (momentum or Nesterov mix) of a piece of a local
        shard into ``out``, casting to its dtype."""
        ...

    def apply(self, param: int, slices: tuple[slice, ...], ortho: torch.Tensor) -> None:
        """Add the scaled orthogonalized update to a piece of a local shard."""
        ...

    def orthogonalize(self, stack: torch.Tensor, ns_key: Hashable) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack."""
        ...

    def watch_finite(self, names: tuple[str, ...], result: torch.Tensor) -> None:
        """Record, without a device sync, whether a Newton–Schulz result is finite."""
        ...


@dataclass
class _Stack:
    """Same-shape, same-schedule owned blocks stacked for one batched kernel call."""

    blocks: list[int]
    offsets: list[int]  # first matrix of each block in the stack
    tensor: torch.Tensor


def _stacks(bucket: BucketPlan, ctx: StepContext) -> list[_Stack]:
    groups: dict[tuple[int, int, Hashable], list[int]] = defaultdict(list)
    for index, block in enumerate(bucket.owned):
        groups[(block.rows, block.cols, block.ns_key)].append(index)
    stacks = []
    for (rows, cols, _), members in groups.items():
        offsets, total = [], 0
        for index in members:
            offsets.append(total)
            total += bucket.owned[index].stop - bucket.owned[index].start
        tensor = torch.empty(total, rows, cols, dtype=ctx.comm_dtype, device=ctx.device)
        stacks.append(_Stack(members, offsets, tensor))
    return stacks


def _block_views(bucket: BucketPlan, stacks: list[_Stack]) -> list[torch.Tensor]:
    """Each owned block's region of its stack, shaped like the block's box."""
    views: list[torch.Tensor] = [torch.empty(0)] * len(bucket.owned)
    for stack in stacks:
        for index, offset in zip(stack.blocks, stack.offsets, strict=True):
            block: OwnedBlock = bucket.owned[index]
            views[index] = stack.tensor[offset : offset + block.stop - block.start].view(
                block.shape
            )
    return views


def bucket_task(bucket: BucketPlan, ctx: StepContext) -> Task:
    """Wrap one bucket's work as a task; it yields once per collective it waits on."""
    return Task(bucket.names, _run_bucket(bucket, ctx))


def _run_bucket(bucket: BucketPlan, ctx: StepContext) -> TaskBody:
    # Buffers are dropped as soon as they are consumed (the collectives keep their own
    # references until they finish), so a bucket waiting on its scatter holds no gather
    # buffers or input stacks while other buckets compute.
    received = None
    if bucket.communicates:
        received, work = _start(
            bucket.gather_sends,
            bucket.gather_recvs,
            lambda p, out: ctx.read_update(p.param, p.slices, out),
            ctx,
        )
        yield
        work.wait()
    stacks = _assemble(bucket, ctx, received)
    del received
    for stack in stacks:
        stack.tensor = ctx.orthogonalize(stack.tensor, bucket.owned[stack.blocks[0]].ns_key)
        ctx.watch_finite(bucket.names, stack.tensor)
    results = _block_views(bucket, stacks)
    del stacks
    for block, result in zip(bucket.owned, results, strict=True):
        if block.own_slices is not None:
            local, inside = block.own_slices
            ctx.apply(block.param, local, result[inside])
    if bucket.communicates:
        received, work = _start(
            bucket.scatter_sends,
            bucket.scatter_recvs,
            lambda p, out: out.copy_(results[p.block][p.slices]),
            ctx,
        )
        del results
        yield
        work.wait()
        for piece, chunk in unpack(received, bucket.scatter_recvs):
            ctx.apply(piece.param, piece.slices, chunk)


def _start(
    sends: Sequence[PieceT],
    recvs: Sequence[LocalPiece] | Sequence[BlockPiece],
    write: Callable[[PieceT, torch.Tensor], object],
    ctx: StepContext,
) -> tuple[torch.Tensor, dist.Work]:
    """Pack the pieces this rank sends and start the all-to-all; returns the receive buffer."""
    send = pack(sends, write, ctx.comm_dtype, ctx.device)
    return start_exchange(send, sends, recvs, ctx.world_size, ctx.peers)


def _assemble(bucket: BucketPlan, ctx: StepContext, received: torch.Tensor | None) -> list[_Stack]:
    """Newton–Schulz input stacks: this rank's own pieces plus the gathered ones."""
    stacks = _stacks(bucket, ctx)
    inputs = _block_views(bucket, stacks)
    for block, view in zip(bucket.owned, inputs, strict=True):
        if block.own_slices is not None:
            local, inside = block.own_slices
            ctx.read_update(block.param, local, view[inside])
    if received is not None:
        for piece, chunk in unpack(received, bucket.gather_recvs):
            inputs[piece.block][piece.slices].copy_(chunk)
    return stacks
