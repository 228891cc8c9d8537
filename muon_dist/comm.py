"""Packed all-to-all exchange of shard pieces: one collective per bucket and direction.

Pieces are packed per peer in plan order, so a buffer needs no headers: sender and receiver
derive the same sizes and offsets from the same plan. Nothing is padded. Where the pieces
lie in a buffer is decided once per plan (:class:`Packing`); a step only allocates the
buffer and takes its views, a few per run of same-shape pieces rather than one per piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from muon_dist.groups import Peers
from muon_dist.plan import BlockPiece, LocalPiece, split_sizes

# Consecutive pieces of one shape in a flat buffer, as (count, shape), in buffer order.
Runs = tuple[tuple[int, tuple[int, ...]], ...]


def shape_runs(shapes: Iterable[tuple[int, ...]]) -> Runs:
    """Group consecutive equal shapes into runs."""
    runs: list[tuple[int, tuple[int, ...]]] = []
    for shape in shapes:
        if runs and runs[-1][1] == shape:
            runs[-1] = (runs[-1][0] + 1, shape)
        else:
            runs.append((1, shape))
    return tuple(runs)


def runs_numel(runs: Runs) -> int:
    return sum(count * math.prod(shape) for count, shape in runs)


def flat_views(buffer: torch.Tensor, runs: Runs) -> list[torch.Tensor]:
    """Views of a flat buffer, one per piece, shaped like the piece: one split for the
    buffer, then a view and an unbind per run (a lone piece takes the view only)."""
    if not runs:
        return []
    sizes = [count * math.prod(shape) for count, shape in runs]
    parts = buffer.split_with_sizes(sizes) if len(sizes) > 1 else [buffer]
    views: list[torch.Tensor] = []
    for part, (count, shape) in zip(parts, runs, strict=True):
        if count == 1:
            views.append(part.view(shape))
        else:
            views.extend(part.view(count, *shape).unbind(0))
    return views


@dataclass(frozen=True)
class Packing:
    """Where one direction of a bucket's pieces lies in its flat buffer, fixed by the plan:
    the elements exchanged with each peer (in the group's rank order) and the pieces' runs."""

    splits: tuple[int, ...]
    runs: Runs

    @property
    def numel(self) -> int:
        return sum(self.splits)


def packing(
    pieces: Sequence[LocalPiece] | Sequence[BlockPiece], world_size: int, peers: Peers
) -> Packing:
    """The packing of ``pieces`` (listed per peer, in plan order) for an all-to-all among
    ``peers``."""
    sizes = split_sizes(pieces, world_size)
    return Packing(tuple(_on_peers(sizes, peers)), shape_runs(p.shape for p in pieces))


def pack(
    layout: Packing,
    fill: Callable[[list[torch.Tensor]], object],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One flat buffer of ``dtype``; ``fill`` gets every piece's view at once, so it can
    write them with a few batched launches rather than one per piece."""
    buffer = torch.empty(layout.numel, dtype=dtype, device=device)
    fill(flat_views(buffer, layout.runs))
    return buffer


def start_exchange(
    send: torch.Tensor, sends: Sequence[int], recvs: Sequence[int], peers: Peers
) -> tuple[torch.Tensor, dist.Work]:
    """Issue the asynchronous all-to-all among ``peers``, ``sends[i]`` elements to and
    ``recvs[i]`` from its i-th rank; the caller waits on the work."""
    recv = torch.empty(sum(recvs), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=list(recvs),
        input_split_sizes=list(sends),
        group=peers.group,
        async_op=True,
    )
    if work is None:
        raise RuntimeError("all_to_all_single(async_op=True) returned no work handle")
    return recv, work


def peer_splits(pieces: Iterable[tuple[int, int]], world_size: int, peers: Peers) -> list[int]:
    """Elements exchanged with each of ``peers`` (group rank order), from ``(peer,
    elements)`` per piece: a step's sizes where they follow its values (Dion2's)."""
    sizes = [0] * world_size
    for peer, numel in pieces:
        sizes[peer] += numel
    return _on_peers(sizes, peers)


def _on_peers(sizes: list[int], peers: Peers) -> list[int]:
    """Per-global-rank sizes as the group's all-to-all takes them, in group rank order."""
    outside = [r for r, n in enumerate(sizes) if n and r not in peers.ranks]
    if outside:
        raise RuntimeError(
            f"muon_dist: a bucket exchanges with ranks {outside} outside its group "
            f"{list(peers.ranks)}; this is a bug in the plan or the group derivation"
        )
    return [sizes[r] for r in peers.ranks]
