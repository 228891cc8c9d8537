"""Dion2's all-to-all buffers: only the elements of the chosen slices travel, as each piece's
rectangles of this step (:class:`muon_dist.plan.dion2_selection.Rect`), written in order into
one send buffer and put back from the receive buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from muon_dist.comm.exchange import Exchanges, start_exchange
from muon_dist.plan.dion2_selection import PieceGrid, Rect, put_, take_into
from muon_dist.plan.packing import peer_splits


def exchange_rects(
    sources: Sequence[torch.Tensor],
    sends: Sequence[PieceGrid],
    send_rects: Sequence[Sequence[Rect]],
    recvs: Sequence[PieceGrid],
    recv_rects: Sequence[Sequence[Rect]],
    exchanges: Exchanges,
) -> tuple[torch.Tensor, dist.Work]:
    """Start the all-to-all of the selected elements, sized by this step's rectangles: each
    piece's (read from its ``sources`` tensor) written in order into one send buffer."""
    rects = [
        (x, r) for x, piece_rects in zip(sources, send_rects, strict=True) for r in piece_rects
    ]
    sizes = [r.numel for _, r in rects]
    send = torch.empty(sum(sizes), dtype=exchanges.dtype, device=exchanges.device)
    for part, (x, rect) in zip(_split(send, sizes), rects, strict=True):
        take_into(part, x, rect)
    return start_exchange(
        send,
        peer_splits(_sizes(sends, send_rects), exchanges.world_size, exchanges.peers.ranks),
        peer_splits(_sizes(recvs, recv_rects), exchanges.world_size, exchanges.peers.ranks),
        exchanges.peers,
    )


def _sizes(pieces: Sequence[PieceGrid], rects: Sequence[Sequence[Rect]]) -> list[tuple[int, int]]:
    return [(p.peer, sum(r.numel for r in rs)) for p, rs in zip(pieces, rects, strict=True)]


def put_all(
    targets: Sequence[torch.Tensor], rects: Sequence[Sequence[Rect]], values: torch.Tensor
) -> None:
    """Write the received flat ``values`` to each piece's rectangles, in order."""
    moves = [(t, r) for t, piece_rects in zip(targets, rects, strict=True) for r in piece_rects]
    for part, (target, rect) in zip(
        _split(values, [r.numel for _, r in moves]), moves, strict=True
    ):
        put_(target, rect, part)


def _split(flat: torch.Tensor, sizes: list[int]) -> Sequence[torch.Tensor]:
    """``flat`` in consecutive parts of ``sizes`` (one split for all)."""
    return flat.split_with_sizes(sizes) if sizes else ()
