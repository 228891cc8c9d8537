"""Which of a bucket's exchange buffers can be its stacks themselves, decided once per plan.

An owner reassembles its stacks from its own pieces and the pieces it receives. Where those
pieces, listed per peer in rank order with its own at its own rank's place, lie end to end in
the stacks' memory (a stack of one ``Shard(0)`` matrix: its row blocks, in rank order), the
gather's receive buffer is the stacks and nothing is copied in. Likewise, where the pieces of
a single result stack for its holders, its own included, lie end to end, the stack is the
scatter's send buffer. The own pieces then travel as the all-to-all's self split, a local
copy inside the collective, instead of a copy of every other piece on the compute stream.

Only the deciding rank's self split changes: what it sends to and receives from every other
rank, and in which order, stays as packed. So each rank decides alone, from its own plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

from muon_dist.plan.build import BlockPiece, BucketPlan, Slices
from muon_dist.plan.packing import Piece

# A run of flat stack memory, [start, stop).
Span = tuple[int, int]

P = TypeVar("P", bound=Piece)


def with_own(pieces: Sequence[P], own: Sequence[P]) -> list[P]:
    """``pieces`` (listed per peer, in rank order) with this rank's ``own`` pieces, whose
    peer is this rank, at its place; the sort is stable, so each peer keeps its order."""
    return sorted([*pieces, *own], key=lambda p: p.peer)


def flat_span(slices: Slices, shape: Sequence[int]) -> Span | None:
    """The flat run of a row-major tensor of ``shape`` that ``slices`` index, or None where
    they index more than one run: every dim after the last cut one must be whole, every dim
    before it one index wide."""
    cut = max(
        (
            d
            for d, (s, n) in enumerate(zip(slices, shape, strict=True))
            if (s.start, s.stop) != (0, n)
        ),
        default=-1,
    )
    if any(s.stop - s.start != 1 for s in slices[: max(cut, 0)]):
        return None
    start = sum(s.start * math.prod(shape[d + 1 :]) for d, s in enumerate(slices))
    return start, start + math.prod(s.stop - s.start for s in slices)


def tiles(spans: Iterable[Span | None], numel: int) -> bool:
    """Whether ``spans``, in order, lie end to end from 0 to ``numel``."""
    end = 0
    for span in spans:
        if span is None or span[0] != end:
            return False
        end = span[1]
    return end == numel


def pieces_tile(
    bucket: BucketPlan, starts: dict[int, int], numel: int, pieces: Sequence[tuple[int, Slices]]
) -> bool:
    """Whether ``(owned block, slices in the block)`` pieces, in order, fill ``numel``
    elements of stack memory exactly, each one run of it (``starts``: each owned block's
    first element there)."""
    spans = []
    for index, slices in pieces:
        span = flat_span(slices, bucket.owned[index].shape)
        first = starts[index]
        spans.append(None if span is None else (first + span[0], first + span[1]))
    return tiles(spans, numel)


def gathers_in_place(
    bucket: BucketPlan, starts: dict[int, int], numel: int, received: Sequence[BlockPiece]
) -> bool:
    """Whether the gather's receive buffer can be the stacks: the bucket communicates, this
    rank receives something (else no copy is saved) and ``received``, its own pieces
    included, tiles the stacks laid end to end."""
    return (
        bucket.communicates
        and bool(bucket.gather_recvs)
        and pieces_tile(bucket, starts, numel, [(p.block, p.slices) for p in received])
    )


def scatters_in_place(
    bucket: BucketPlan, stacks: int, starts: dict[int, int], numel: int, sent: Sequence[BlockPiece]
) -> bool:
    """Whether the scatter can send the result stack itself: the bucket communicates, this
    rank owns one stack (a send buffer is one tensor) and returns something, and ``sent``,
    its own pieces included, tiles that stack."""
    return (
        bucket.communicates
        and stacks == 1
        and bool(bucket.scatter_sends)
        and pieces_tile(bucket, starts, numel, [(p.block, p.slices) for p in sent])
    )
