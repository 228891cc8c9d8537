"""Where Dion2's slices lie in a bucket, and which elements of each piece travel: pure
planning on the host, no communication and no kernels.

Every matrix view is seen as a grid of *flat rows* (its leading dimensions flattened) by
*flat columns* (the trailing ones), so a matrix, a part of one, a shard and a piece of a
shard are each a product of a row set and a column set. A :class:`Segment` is what Dion2
selects in: one matrix, or one part of it, with the axis its slices run along. A bucket
lays its segments out in a vector of slice norms (:class:`BucketSelection`); every rank
adds its pieces' partial norms there (:meth:`BucketSelection.tiles`), one all-reduce sums
them, every rank takes the same top slices (:func:`muon_dist.rules.dion2_slices.top_slices`), and
each piece then moves only its elements in selected slices, as a few rectangles
(:class:`Rect`, :meth:`BucketSelection.rects`).

Coordinates: *flat* ones index the whole parameter; a local piece is read as ``[len(rows),
len(cols)]`` of its own flat ids; an owner's stack as ``[matrices·rows, cols]``. What a
step computes (:meth:`BucketSelection.rects`) is numpy on the host, well under a
microsecond per operation where torch's CPU dispatch takes several, and reaches the device
as one vector (:func:`rect_indices`, :func:`device_rects`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from muon_dist.plan.bucket_map import StackSpec, stack_places
from muon_dist.plan.build import Block, BucketPlan
from muon_dist.plan.views import Box, MatrixView, PartSplit
from muon_dist.rules.dion2_slices import selected_count

_LONG = torch.long


def _ids(box: Sequence[tuple[int, int]], shape: Sequence[int]) -> torch.Tensor:
    """Row-major flat ids of a box of a tensor of ``shape`` (sorted ascending)."""
    ids = torch.zeros((), dtype=_LONG)
    for (lo, hi), size in zip(box, shape, strict=True):
        ids = (ids.unsqueeze(-1) * size + torch.arange(lo, hi, dtype=_LONG)).reshape(-1)
    return ids.reshape(-1)


def _leading(view: MatrixView) -> int:
    """How many leading dimensions of the parameter form a view's flat rows."""
    return 2 if view.kind in ("expert_stack", "slice") else 1


def grid(view: MatrixView, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
    """A box of the parameter as (flat rows, flat columns)."""
    j = _leading(view)
    return _ids(box[:j], view.shape[:j]), _ids(box[j:], view.shape[j:])


def first_row(view: MatrixView, matrix: int) -> int:
    """The flat row where ``matrix`` of ``view`` begins."""
    return int(grid(view, view.box(matrix, matrix + 1))[0][0])


@dataclass(frozen=True)
class Segment:
    """One matrix, or one part of it, that Dion2 selects in: the product of ``rows`` and
    ``cols`` (flat ids, ascending), whose slices are its rows (``axis`` 0) or columns (1);
    ``count`` of them are chosen. Its norms start at ``slot``, its choice at ``chosen``."""

    rows: torch.Tensor
    cols: torch.Tensor
    axis: int
    count: int
    slot: int = 0
    chosen: int = 0

    @property
    def length(self) -> int:
        return len(self.rows if self.axis == 0 else self.cols)


def _slice_axis(out_dim: int, in_dim: int, output_axis: int) -> int:
    """The stored axis Dion2 selects along: the outputs when there are no more of them than
    inputs, else the inputs (as :func:`muon_dist.rules.dion2_slices.selected_orthogonalize`)."""
    return output_axis if out_dim <= in_dim else 1 - output_axis


def matrix_segments(
    view: MatrixView, matrix: int, fraction: float, parts: PartSplit | None
) -> list[Segment]:
    """The segments of one matrix: itself, or each of its parts in order."""
    rows, cols = grid(view, view.box(matrix, matrix + 1))
    output_axis = 1 if view.transposed else 0
    if parts is None:
        out_dim, in_dim = view.out_in
        axis = _slice_axis(out_dim, in_dim, output_axis)
        length = len(rows if axis == 0 else cols)
        return [Segment(rows, cols, axis, selected_count(length, fraction))]
    outputs = rows if output_axis == 0 else cols
    inputs = cols if output_axis == 0 else rows
    per_group = len(outputs) // parts.groups
    segments: list[Segment] = []
    offset = 0
    for size in parts.sizes:
        mine = torch.cat(
            [
                outputs[g * per_group + offset : g * per_group + offset + size]
                for g in range(parts.groups)
            ]
        )
        offset += size
        axis = _slice_axis(len(mine), len(inputs), output_axis)
        part_rows, part_cols = (mine, inputs) if output_axis == 0 else (inputs, mine)
        length = len(part_rows if axis == 0 else part_cols)
        segments.append(Segment(part_rows, part_cols, axis, selected_count(length, fraction)))
    return segments


@dataclass(frozen=True)
class Overlap:
    """The elements of ``segment`` (its index in the bucket; -1: a whole piece that moves
    as it is, not Dion2's) inside a piece: flat ``rows`` x ``cols``, and the same in the
    coordinates of the tensor the piece is read from (``rows_at``, ``cols_at``, numpy).
    ``lookup`` maps each of the segment's slices to its coordinate there (-1: outside the
    piece), so a step turns the chosen slices into coordinates with one indexing."""

    segment: int
    rows: torch.Tensor
    cols: torch.Tensor
    rows_at: np.ndarray
    cols_at: np.ndarray
    lookup: np.ndarray | None = None
    whole: bool = True  # every slice of the segment lies (in part) inside the piece


@dataclass(frozen=True)
class PieceGrid:
    """A piece of a bucket: its flat ``rows`` and ``cols``, its overlaps with the segments,
    and its peer; ``stack_row``, for an owner's piece, maps a flat row to a row of its
    stack's ``[matrices·rows, cols]`` view (add it), and is None for a piece of a local
    shard."""

    rows: torch.Tensor
    cols: torch.Tensor
    overlaps: tuple[Overlap, ...]
    peer: int  # the rank it comes from or goes to
    width: int  # columns of the 2-D tensor it is read from: its own, or its stack's
    stack: int = -1  # an owner's piece: its stack's position in the bucket
    stack_row: int | None = None


@dataclass(frozen=True)
class HostRect:
    """Elements of a piece that travel together: for each of ``g`` groups (``shape`` is
    ``(g, a, b)``), the product of ``rows[i]`` and ``cols[i]`` (``[g, a]`` and ``[g, b]``,
    in the piece's or the stack's coordinates), their values laid out ``[g, a, b]``. Rows
    (columns) None: all of the tensor's, in order, in one group. Planned on the host
    (numpy); a :class:`Rect` is the same on the device."""

    shape: tuple[int, int, int]
    rows: np.ndarray | None
    cols: np.ndarray | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Rect:
    """A :class:`HostRect` whose indices are tensors on the device it indexes, flat (its
    ``g·a`` rows, ``g·b`` columns): one group's index is used as it is, several groups'
    take a view."""

    shape: tuple[int, int, int]
    rows: torch.Tensor | None
    cols: torch.Tensor | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def take(x: torch.Tensor, rect: Rect) -> torch.Tensor:
    """The values of ``rect`` in a 2-D ``x``, flat."""
    if rect.rows is None:
        return x.reshape(-1) if rect.cols is None else x.index_select(1, rect.cols).reshape(-1)
    if rect.cols is None:
        return x.index_select(0, rect.rows).reshape(-1)
    return x[_grouped(rect.rows, rect.cols, rect.shape)].reshape(-1)


def take_into(out: torch.Tensor, x: torch.Tensor, rect: Rect) -> None:
    """Write the values of ``rect`` in a 2-D ``x`` into the flat ``out``, cast to its dtype
    (one pass where the dtypes agree: a send buffer filled without a gather and a copy)."""
    _, a, b = rect.shape
    if out.dtype == x.dtype and rect.rows is None and rect.cols is not None:
        torch.index_select(x, 1, rect.cols, out=out.view(a, b))
    elif out.dtype == x.dtype and rect.rows is not None and rect.cols is None:
        torch.index_select(x, 0, rect.rows, out=out.view(a, b))
    else:
        out.copy_(take(x, rect))


def put_(x: torch.Tensor, rect: Rect, values: torch.Tensor) -> None:
    """Write flat ``values`` to ``rect`` of a 2-D ``x``."""
    g, a, b = rect.shape
    if rect.rows is None:
        if rect.cols is None:
            x.copy_(values.view(a, b))
        else:
            x.index_copy_(1, rect.cols, values.view(a, b))
    elif rect.cols is None:
        x.index_copy_(0, rect.rows, values.view(a, b))
    else:
        x.index_put_(_grouped(rect.rows, rect.cols, rect.shape), values.view(g, a, b))


def _grouped(
    rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rectangle's flat row and column indices, broadcast as ``[g, a, b]``."""
    g, a, b = shape
    return rows.view(g, a, 1), cols.view(g, 1, b)


class BucketSelection:
    """Dion2's layout in one bucket: the segments of its Dion2 blocks (in the bucket's
    order, the same on every rank) with their places in the norm vector, batched for the
    top-k by (length, count), and the grid of each piece this rank sends, receives or
    owns. Built once per plan; :meth:`rects` turns a step's choice into what moves."""

    def __init__(
        self,
        bucket: BucketPlan,
        rank: int,
        members: Collection[int],
        views: Sequence[MatrixView],
        selects: Mapping[int, tuple[float, PartSplit | None]],
        local_box: Callable[[int], Box],
        stacks: Sequence[StackSpec],
    ) -> None:
        """``members``: the ranks this rank exchanges with (a block owned elsewhere is
        another group's); ``selects``: per Dion2 view (plan index), its fraction and parts;
        ``local_box``: this rank's box of a view; ``stacks``: the bucket's stacks."""
        self._lay_out_segments(bucket, members, views, selects)
        blocks = {(b.view, b.owner, b.start, b.stop): b for b in bucket.blocks}
        places = stack_places(stacks)
        owned = [blocks[(o.view, rank, o.start, o.stop)] for o in bucket.owned]
        self._lay_out_pieces(bucket, rank, views, local_box, stacks, owned, places)
        self._lay_out_choices(owned, places)

    def _lay_out_segments(
        self,
        bucket: BucketPlan,
        members: Collection[int],
        views: Sequence[MatrixView],
        selects: Mapping[int, tuple[float, PartSplit | None]],
    ) -> None:
        """The segments of the bucket's Dion2 blocks, their slots and the top-k batches."""
        found: list[Segment] = []
        self.segment_views: list[int] = []  # each segment's view
        self._of_block: dict[int, list[int]] = {}
        self._of_matrix: dict[tuple[int, int], list[int]] = {}
        for block in bucket.blocks:
            if block.view not in selects or block.owner not in members:
                continue
            fraction, parts = selects[block.view]
            for matrix in range(block.start, block.stop):
                for s in matrix_segments(views[block.view], matrix, fraction, parts):
                    self.segment_views.append(block.view)
                    self._of_block.setdefault(id(block), []).append(len(found))
                    self._of_matrix.setdefault((id(block), matrix), []).append(len(found))
                    found.append(s)
        kinds: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(found):
            kinds.setdefault((s.length, s.count), []).append(i)
        self.segments = list(found)
        # Per batch: (first slot, segments, length, count, first chosen position).
        self.batches: list[tuple[int, int, int, int, int]] = []
        slot = chosen = 0
        for (length, count), alike in kinds.items():
            self.batches.append((slot, len(alike), length, count, chosen))
            for i in alike:
                s = found[i]
                self.segments[i] = Segment(s.rows, s.cols, s.axis, s.count, slot, chosen)
                slot += length
                chosen += count
        self.slots, self.chosen_count = slot, chosen

    def _lay_out_pieces(
        self,
        bucket: BucketPlan,
        rank: int,
        views: Sequence[MatrixView],
        local_box: Callable[[int], Box],
        stacks: Sequence[StackSpec],
        owned: Sequence[Block],
        places: Mapping[int, tuple[int, int]],
    ) -> None:
        """The grid of each piece this rank sends, receives or owns."""

        def local_piece(view: int, owner: int, slices: tuple[slice, ...]) -> PieceGrid:
            full = _shifted(local_box(view), slices)
            block = next(
                b
                for b in bucket.blocks
                if (b.view, b.owner) == (view, owner) and b.box[0][0] <= full[0][0] < b.box[0][1]
            )
            rows, cols = grid(views[view], full)
            return PieceGrid(rows, cols, self._overlaps(block, rows, cols, None), owner, len(cols))

        def owned_piece(index: int, slices: tuple[slice, ...], peer: int) -> PieceGrid:
            block = owned[index]
            view = views[block.view]
            rows, cols = grid(view, _shifted(block.box, slices))
            stack, offset = places[index]
            shift = offset * stacks[stack].shape[1] - first_row(view, block.start)
            overlaps = self._overlaps(block, rows, cols, shift)
            return PieceGrid(rows, cols, overlaps, peer, view.cols, stack, shift)

        self.gather_sends = [local_piece(p.view, p.peer, p.slices) for p in bucket.gather_sends]
        self.gather_recvs = [owned_piece(p.block, p.slices, p.peer) for p in bucket.gather_recvs]
        self.scatter_sends = [owned_piece(p.block, p.slices, p.peer) for p in bucket.scatter_sends]
        self.scatter_recvs = [local_piece(p.view, p.peer, p.slices) for p in bucket.scatter_recvs]
        self.own = [
            owned_piece(i, b.own_slices[1], rank)
            for i, b in enumerate(bucket.owned)
            if b.own_slices is not None
        ]

    def _lay_out_choices(
        self, owned: Sequence[Block], places: Mapping[int, tuple[int, int]]
    ) -> None:
        """Per stack position, per part: each matrix's chosen positions, [matrices, count]."""
        self.stack_chosen: dict[int, list[torch.Tensor]] = {}
        for index, block in enumerate(owned):
            if id(block) not in self._of_block:
                continue
            position = places[index][0]
            per_part = list(
                zip(
                    *(self._of_matrix[(id(block), m)] for m in range(block.start, block.stop)),
                    strict=True,
                )
            )
            rows = [torch.stack([self._choice(i) for i in part]) for part in per_part]
            held = self.stack_chosen.get(position)
            self.stack_chosen[position] = (
                rows if held is None else [torch.cat(pair) for pair in zip(held, rows, strict=True)]
            )

    def _choice(self, segment: int) -> torch.Tensor:
        s = self.segments[segment]
        return torch.arange(s.chosen, s.chosen + s.count, dtype=_LONG)

    def _overlaps(
        self, block: Block, rows: torch.Tensor, cols: torch.Tensor, stack_row: int | None
    ) -> tuple[Overlap, ...]:
        """A piece's overlaps; ``stack_row`` as :class:`PieceGrid`'s."""

        def rows_at(flat: torch.Tensor) -> np.ndarray:
            at = torch.searchsorted(rows, flat) if stack_row is None else flat + stack_row
            return at.numpy()

        def cols_at(flat: torch.Tensor) -> np.ndarray:
            return (torch.searchsorted(cols, flat) if stack_row is None else flat).numpy()

        members = self._of_block.get(id(block))
        if members is None:  # not Dion2's: the piece moves whole
            return (Overlap(-1, rows, cols, rows_at(rows), cols_at(cols)),)
        overlaps: list[Overlap] = []
        for i in members:
            s = self.segments[i]
            inner_rows = rows[torch.isin(rows, s.rows)]
            inner_cols = cols[torch.isin(cols, s.cols)]
            if not (len(inner_rows) and len(inner_cols)):
                continue
            slices, inner, at = (
                (s.rows, inner_rows, rows_at) if s.axis == 0 else (s.cols, inner_cols, cols_at)
            )
            inside = torch.isin(slices, inner)
            lookup = np.full(len(slices), -1, dtype=np.int64)
            lookup[inside.numpy()] = at(slices[inside])
            overlaps.append(
                Overlap(
                    i,
                    inner_rows,
                    inner_cols,
                    rows_at(inner_rows),
                    cols_at(inner_cols),
                    lookup,
                    bool(inside.all()),
                )
            )
        return tuple(overlaps)

    # -- norms ------------------------------------------------------------------------------

    def tiles(self, piece: PieceGrid) -> list[tuple[HostRect, int, np.ndarray]]:
        """A source piece's share of the norms: per batch of like overlaps, its rectangle
        (in the piece's or, for an owner, the stack's coordinates), the axis its slices run
        along, and their slots ``[g, a]`` (rows) or ``[g, b]``."""
        batches: dict[tuple[int, int, int], list[Overlap]] = {}
        for o in piece.overlaps:
            if o.segment < 0:
                continue
            axis = self.segments[o.segment].axis
            batches.setdefault((axis, len(o.rows), len(o.cols)), []).append(o)
        out = []
        for (axis, _, _), members in batches.items():
            slots = []
            for o in members:
                s = self.segments[o.segment]
                ids, within = (s.rows, o.rows) if axis == 0 else (s.cols, o.cols)
                slots.append((s.slot + torch.searchsorted(ids, within)).numpy())
            rect = _rect(piece, [o.rows_at for o in members], [o.cols_at for o in members])
            out.append((rect, axis, np.stack(slots)))
        return out

    # -- what moves -------------------------------------------------------------------------

    def rects(self, piece: PieceGrid, chosen: np.ndarray) -> list[HostRect]:
        """The elements of ``piece`` in selected slices (all of a piece that is not
        Dion2's), given the step's host copy of the chosen positions, as rectangles in the
        piece's or the stack's coordinates, batched by shape in a fixed order."""
        batches: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for o in piece.overlaps:
            rows, cols = o.rows_at, o.cols_at
            if o.lookup is not None:
                s = self.segments[o.segment]
                at = o.lookup[chosen[s.chosen : s.chosen + s.count]]
                if not o.whole:
                    at = at[at >= 0]
                rows, cols = (at, cols) if s.axis == 0 else (rows, at)
            if len(rows) and len(cols):
                pair = batches.setdefault((len(rows), len(cols)), ([], []))
                pair[0].append(rows)
                pair[1].append(cols)
        return [_rect(piece, rows, cols) for rows, cols in batches.values()]


def _rect(piece: PieceGrid, rows: Sequence[np.ndarray], cols: Sequence[np.ndarray]) -> HostRect:
    """A rectangle of like overlaps, in the coordinates of the tensor ``piece`` is read from."""
    row_at = rows[0][None] if len(rows) == 1 else np.stack(rows)
    col_at = cols[0][None] if len(cols) == 1 else np.stack(cols)
    (g, a), b = row_at.shape, col_at.shape[1]
    height = len(piece.rows) if piece.stack_row is None else -1  # a stack is never one piece
    return HostRect(
        (g, a, b),
        None if g == 1 and a == height else row_at,
        None if g == 1 and b == piece.width else col_at,
    )


def _shifted(box: Box, slices: Sequence[slice]) -> Box:
    """``slices`` of a tensor holding ``box``, as a box of the parameter."""
    return tuple((lo + s.start, lo + s.stop) for (lo, _), s in zip(box, slices, strict=True))


def rect_indices(rects: Sequence[Sequence[HostRect]]) -> np.ndarray:
    """All of the rectangles' indices in one vector, for one host-to-device copy."""
    host = [
        t.reshape(-1) for piece in rects for r in piece for t in (r.rows, r.cols) if t is not None
    ]
    return np.concatenate(host) if host else np.empty(0, dtype=np.int64)


def device_rects(rects: Sequence[Sequence[HostRect]], flat: torch.Tensor) -> list[list[Rect]]:
    """``rects`` as :class:`Rect` parts of ``flat``, their :func:`rect_indices` on a device
    (one split for all)."""
    sizes = [t.size for piece in rects for r in piece for t in (r.rows, r.cols) if t is not None]
    parts = iter(flat.split_with_sizes(sizes) if sizes else ())

    def part(t: np.ndarray | None) -> torch.Tensor | None:
        return None if t is None else next(parts)

    return [[Rect(r.shape, part(r.rows), part(r.cols)) for r in piece] for piece in rects]
