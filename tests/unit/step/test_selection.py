"""Dion2's layout in a bucket (``muon_dist.plan.dion2_selection``), checked across simulated ranks
without processes: every rank lays the slice norms out alike, the pieces' partial norms add
up to each slice's norm, and each all-to-all's sender and receiver agree on which selected
elements travel, in which order, covering exactly the selected slices."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_dist.comm.dion2_exchange import DeviceSelection
from muon_dist.comm.groups import Peers
from muon_dist.plan.bucket_map import bucket_map
from muon_dist.plan.build import ViewPlacement, build_plan, local_boxes
from muon_dist.plan.dion2_selection import BucketSelection, HostRect, PieceGrid, grid
from muon_dist.plan.views import matrix_view
from muon_dist.step.wings.dion2 import add_norms


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[ViewPlacement], int, dict[int, float]]:
    """Random views (matrices wide and tall, heads, experts, fused experts, parts cut on
    the owner, ``[in, out]`` storage) on a random mesh, some of them Dion2's."""
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (1, 3)]))
    world = math.prod(mesh)
    layouts: list[ViewPlacement] = []
    fractions: dict[int, float] = {}
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["matrix", "experts", "fused", "heads", "parts"]))
        rows, cols = draw(st.integers(2, 9)), draw(st.integers(2, 9))
        options: dict[str, object] = {}
        shape: tuple[int, ...] = (rows, cols)
        if kind == "experts":
            shape = (draw(st.integers(1, 4)), rows, cols)
            options["experts"] = True
        elif kind == "fused":
            shape = (2 * rows, cols)
            options["num_experts"] = 2
        elif kind == "heads":
            shape = (3 * rows, cols)
            options["num_heads"] = 3
        view = matrix_view(shape, name=f"p{i}", **options)  # type: ignore[arg-type]
        if kind == "parts":
            transposed = draw(st.booleans())
            out = cols if transposed else rows
            view = matrix_view((rows, cols), name=f"p{i}")
            groups = draw(st.sampled_from([g for g in (1, 2) if out % g == 0]))
            first = draw(st.integers(1, out // groups - 1)) if out // groups > 1 else None
            if first is not None:
                sizes = (first, out // groups - first)
                view = dataclasses.replace(view, transposed=transposed, parts=(sizes, groups))
        dims = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh)
        if draw(st.booleans()) or i == 0:
            fractions[i] = draw(st.sampled_from([0.25, 0.5, 1.0]))
        # As plan.recipes.stack_recipe: a stack holds matrices of one rule, fraction and cut.
        key = (5, "quintic", view.parts, view.transposed, fractions.get(i))
        layouts.append(ViewPlacement(f"p{i}", view, mesh, tuple(range(world)), dims, key))
    return layouts, world, fractions


def _ids(piece: PieceGrid, rect: HostRect) -> list[tuple[int, int]]:
    """The flat (row, column) of each value a rectangle moves, in its order."""
    height = len(piece.rows) if piece.stack_row is None else 0
    every = {"rows": torch.arange(height)[None], "cols": torch.arange(piece.width)[None]}
    rows, cols = (
        every[axis] if getattr(rect, axis) is None else torch.from_numpy(getattr(rect, axis))
        for axis in ("rows", "cols")
    )
    rows, cols = rows.unsqueeze(-1), cols.unsqueeze(-2)
    if piece.stack_row is None:
        rows, cols = piece.rows[rows], piece.cols[cols]
    else:
        rows = rows - piece.stack_row
    rows, cols = torch.broadcast_tensors(rows, cols)
    return list(zip(rows.reshape(-1).tolist(), cols.reshape(-1).tolist(), strict=True))


@settings(max_examples=60, deadline=None)
@given(_layouts(), st.sampled_from(["split", "redundant"]), st.integers(0, 2**16))
def test_ranks_agree_on_norms_and_on_what_travels(
    case: tuple[list[ViewPlacement], int, dict[int, float]], mode: str, seed: int
) -> None:
    layouts, world, fractions = case
    views = [p.view for p in layouts]
    selects = {i: (f, views[i].part_split(None)) for i, f in fractions.items()}
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(p.view.shape, generator=gen, dtype=torch.float64) for p in layouts]
    planes = [
        f.reshape(len(grid(v, tuple((0, s) for s in v.shape))[0]), -1)
        for f, v in zip(fulls, views, strict=True)
    ]
    peers = Peers(tuple(range(world)), None)
    per_rank = []
    for rank in range(world):
        plan = build_plan(layouts, rank, world, bucket_bytes=256, itemsize=4, replica_mode=mode)
        selections = []
        for bucket in plan.buckets:
            where = bucket_map(bucket, 0, world, peers.ranks)
            selections.append(
                BucketSelection(
                    bucket,
                    rank,
                    peers.ranks,
                    views,
                    selects,
                    lambda v, r=rank: local_boxes(layouts[v])[r],
                    where.stacks,
                )
            )
        per_rank.append((plan, selections))
    for b in range(len(per_rank[0][0].buckets)):
        first = per_rank[0][1][b]
        for _, selections in per_rank[1:]:
            assert _layout_of(selections[b]) == _layout_of(first)
        _check_norms(per_rank, b, planes)
        chosen = torch.zeros(first.chosen_count, dtype=torch.long)
        for s in first.segments:
            pick = torch.randperm(s.length, generator=gen)[: s.count]
            chosen[s.chosen : s.chosen + s.count] = pick.sort().values
        _check_transport(per_rank, b, chosen)


def _layout_of(sel: BucketSelection) -> list[tuple[int, ...]]:
    return [(len(s.rows), len(s.cols), s.axis, s.count, s.slot, s.chosen) for s in sel.segments]


def _check_norms(per_rank: list[Any], b: int, planes: list[torch.Tensor]) -> None:
    """Every rank's sources' partial norms add up to each slice's L1 norm."""
    first = per_rank[0][1][b]
    total = torch.zeros(first.slots, dtype=torch.float64)
    for plan, selections in per_rank:
        sel, bucket = selections[b], plan.buckets[b]
        layout = DeviceSelection(sel, torch.device("cpu"))
        for piece, p, tiles in zip(
            sel.gather_sends, bucket.gather_sends, layout.send_tiles, strict=True
        ):
            x = planes[p.view][piece.rows][:, piece.cols]
            add_norms(total, [(x, tiles)], "torch")
        owned = [o for o in bucket.owned if o.own_slices]
        for piece, owned_block, tiles in zip(sel.own, owned, layout.own_tiles, strict=True):
            stack_plane = torch.zeros(
                piece.stack_row + int(piece.rows.max()) + 1, piece.width, dtype=torch.float64
            )
            stack_plane[piece.rows + piece.stack_row] = planes[owned_block.view][piece.rows]
            add_norms(total, [(stack_plane, tiles)], "torch")
    for s, block_view in zip(first.segments, first.segment_views, strict=True):
        values = planes[block_view][s.rows][:, s.cols].abs()
        expected = values.sum(1) if s.axis == 0 else values.sum(0)
        assert torch.allclose(total[s.slot : s.slot + s.length], expected, rtol=1e-12), s


def _check_transport(per_rank: list[Any], b: int, chosen: torch.Tensor) -> None:
    """Per (sender, receiver), in both exchanges: the same elements in the same order."""
    for sends_of, recvs_of in (
        ("gather_sends", "gather_recvs"),
        ("scatter_sends", "scatter_recvs"),
    ):
        sent: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        received: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        choice = chosen.numpy()
        for rank, (_, selections) in enumerate(per_rank):
            sel = selections[b]
            for piece in getattr(sel, sends_of):
                for rect in sel.rects(piece, choice):
                    sent[(rank, piece.peer)] += _ids(piece, rect)
            for piece in getattr(sel, recvs_of):
                for rect in sel.rects(piece, choice):
                    received[(piece.peer, rank)] += _ids(piece, rect)
        assert dict(sent) == dict(received)
