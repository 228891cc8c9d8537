"""Packed all-to-all exchange of shard pieces: one collective per bucket and direction.

Pieces are packed per peer in plan order, so a buffer needs no headers: sender and receiver
derive the same sizes and offsets from the same plan. Nothing is padded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from muon_dist.groups import Peers
from muon_dist.plan import BlockPiece, LocalPiece, split_sizes

PieceT = TypeVar("PieceT", LocalPiece, BlockPiece)


def pack(
    pieces: Sequence[PieceT],
    fill: Callable[[list[tuple[PieceT, torch.Tensor]]], object],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One flat buffer of ``dtype``; ``fill`` gets every ``(piece, view)`` at once, so it
    can write them with a few batched launches rather than one per piece."""
    numels = [math.prod(p.shape) for p in pieces]
    buffer = torch.empty(sum(numels), dtype=dtype, device=device)
    chunks = buffer.split_with_sizes(numels)
    fill([(p, c.view(p.shape)) for p, c in zip(pieces, chunks, strict=True)])
    return buffer


def unpack(buffer: torch.Tensor, pieces: Sequence[PieceT]) -> Iterator[tuple[PieceT, torch.Tensor]]:
    """Views of a received buffer, one per piece, shaped like the piece."""
    numels = [math.prod(p.shape) for p in pieces]
    for piece, chunk in zip(pieces, buffer.split_with_sizes(numels), strict=True):
        yield piece, chunk.view(piece.shape)


def start_exchange(
    send: torch.Tensor,
    sends: Sequence[PieceT],
    recvs: Sequence[LocalPiece] | Sequence[BlockPiece],
    world_size: int,
    peers: Peers,
) -> tuple[torch.Tensor, dist.Work]:
    """Issue the asynchronous all-to-all among ``peers``; the caller waits on the work."""
    send_splits = _on_peers(split_sizes(sends, world_size), peers)
    recv_splits = _on_peers(split_sizes(recvs, world_size), peers)
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=peers.group,
        async_op=True,
    )
    if work is None:
        raise RuntimeError("all_to_all_single(async_op=True) returned no work handle")
    return recv, work


def _on_peers(sizes: list[int], peers: Peers) -> list[int]:
    """Per-global-rank sizes as the group's all-to-all takes them, in group rank order."""
    outside = [r for r, n in enumerate(sizes) if n and r not in peers.ranks]
    if outside:
        raise RuntimeError(
            f"muon_dist: a bucket exchanges with ranks {outside} outside its group "
            f"{list(peers.ranks)}; this is a bug in the plan or the group derivation"
        )
    return [sizes[r] for r in peers.ranks]
