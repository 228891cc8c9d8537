"""Where a bucket's pieces lie in its flat exchange buffers: decided once per plan, alike on
every rank.

Pieces are packed per peer in plan order, so a buffer needs no headers: sender and receiver
derive the same sizes and offsets from the same plan. Nothing is padded. A step only
allocates the buffer and takes its views, a few per run of same-shape pieces rather than one
per piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Piece(Protocol):
    """A piece of an exchange, as a plan lists it: the peer it travels to or from, its shape."""

    @property
    def peer(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def peer_sizes(pieces: Sequence[Piece], world_size: int) -> list[int]:
    """Elements exchanged with each global rank, from pieces listed in packing order."""
    sizes = [0] * world_size
    for piece in pieces:
        sizes[piece.peer] += math.prod(piece.shape)
    return sizes


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


def packing(pieces: Sequence[Piece], world_size: int, ranks: Sequence[int]) -> Packing:
    """The packing of ``pieces`` (listed per peer, in plan order) for an all-to-all among
    ``ranks`` (a group's global ranks, in its rank order)."""
    sizes = peer_sizes(pieces, world_size)
    return Packing(tuple(_on_peers(sizes, ranks)), shape_runs(p.shape for p in pieces))


def peer_splits(
    pieces: Iterable[tuple[int, int]], world_size: int, ranks: Sequence[int]
) -> list[int]:
    """Elements exchanged with each of ``ranks`` (group rank order), from ``(peer,
    elements)`` per piece: a step's sizes where they follow its values (Dion2's)."""
    sizes = [0] * world_size
    for peer, numel in pieces:
        sizes[peer] += numel
    return _on_peers(sizes, ranks)


def _on_peers(sizes: list[int], ranks: Sequence[int]) -> list[int]:
    """Per-global-rank sizes as the group's all-to-all takes them, in group rank order."""
    outside = [r for r, n in enumerate(sizes) if n and r not in ranks]
    if outside:
        raise RuntimeError(
            f"muon_dist: a bucket exchanges with ranks {outside} outside its group "
            f"{list(ranks)}; this is a bug in the plan or the group derivation"
        )
    return [sizes[r] for r in ranks]
