"""Which exchange buffers serve as a bucket's stacks (plan/in_place.py), checked without
processes: the spans, the decision on typical layouts, and a simulated exchange among all
ranks in which every rank decides alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from view_placements import placement, random_placements

from muon_dist.plan.bucket_map import BucketMap, bucket_map, region_views, stack_views
from muon_dist.plan.build import BucketPlan, Plan, ViewPlacement, build_plan, local_boxes
from muon_dist.plan.in_place import flat_span, tiles
from muon_dist.plan.packing import flat_views

# 1 to 5 views, stacks of up to 3 experts, up to 3 fused ones.
RANDOM_LAYOUTS = random_placements(max_views=5, max_stack=3, max_fused=3)


def _cut(*bounds: tuple[int, int]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


def test_flat_span_is_one_run_of_row_major_memory_or_none() -> None:
    assert flat_span(_cut((0, 4), (0, 6)), (4, 6)) == (0, 24)
    assert flat_span(_cut((1, 3), (0, 6)), (4, 6)) == (6, 18), "a row block"
    assert flat_span(_cut((0, 4), (0, 3)), (4, 6)) is None, "a column block"
    assert flat_span(_cut((2, 3), (1, 4)), (4, 6)) == (13, 16), "part of one row"
    assert flat_span(_cut((1, 2), (2, 4), (0, 5)), (3, 4, 5)) == (30, 40), "rows of one matrix"
    assert flat_span(_cut((0, 2), (2, 4), (0, 5)), (3, 4, 5)) is None, "rows of two matrices"


def test_tiles_needs_every_span_end_to_end() -> None:
    assert tiles([(0, 4), (4, 10)], 10)
    assert tiles([], 0)
    assert not tiles([(4, 10), (0, 4)], 10), "out of order"
    assert not tiles([(0, 4), (4, 10)], 12), "short"
    assert not tiles([(0, 4), None], 4), "a piece in two runs"
    assert not tiles([(0, 4), (2, 6)], 6), "overlapping"


def _maps(
    layouts: list[ViewPlacement], world: int, in_place: bool, mode: str = "split", budget: int = 1
) -> list[list[BucketMap]]:
    """Per rank, its bucket maps (stacks numbered from 0 in each bucket)."""
    plans = _plans(layouts, world, mode, budget)
    ranks = tuple(range(world))
    return [
        [bucket_map(b, 0, world, ranks, rank if in_place else None) for b in plan.buckets]
        for rank, plan in enumerate(plans)
    ]


def _plans(layouts: list[ViewPlacement], world: int, mode: str, budget: int) -> list[Plan]:
    return [
        build_plan(layouts, r, world, bucket_bytes=budget, itemsize=4, replica_mode=mode)
        for r in range(world)
    ]


def _decisions(maps: list[list[BucketMap]]) -> set[tuple[bool, bool]]:
    return {
        (m.gather_in_place, m.scatter_in_place) for per_rank in maps for m in per_rank if m.stacks
    }


def test_one_shard0_matrix_per_owner_travels_in_place() -> None:
    # A bucket per round of one matrix per owner (the llama MLP's case), tall and wide,
    # rows uneven over 4 ranks and one rank without rows of the 3-row matrices.
    layouts = [placement(f"w{i}", shape, (4,), (0,)) for i, shape in enumerate([(14, 8)] * 4)]
    layouts += [placement(f"v{i}", shape, (4,), (0,)) for i, shape in enumerate([(8, 14)] * 4)]
    layouts += [placement(f"u{i}", shape, (4,), (0,)) for i, shape in enumerate([(3, 5)] * 4)]
    assert _decisions(_maps(layouts, 4, True)) == {(True, True)}
    assert _decisions(_maps(layouts, 4, False)) == {(False, False)}


@pytest.mark.parametrize(
    ("mesh", "dims", "mode", "decided"),
    [
        ((2,), (1,), "split", {(False, False)}),  # column blocks: not one run each
        ((2,), (None,), "split", {(False, False)}),  # replicated: nothing received
        ((2, 2), (None, 0), "split", {(True, False)}),  # both replicas get the result back
        ((2, 2), (None, 0), "redundant", {(True, True)}),  # each replica its own copy
    ],
    ids=["shard1", "replicated", "hsdp_split", "hsdp_redundant"],
)
def test_other_layouts(
    mesh: tuple[int, ...], dims: tuple[int | None, ...], mode: str, decided: set[tuple[bool, bool]]
) -> None:
    layouts = [placement(f"w{i}", (6, 4), mesh, dims) for i in range(math.prod(mesh))]
    assert _decisions(_maps(layouts, math.prod(mesh), True, mode)) == decided


def test_several_matrices_in_a_stack_stay_packed() -> None:
    # One bucket: each owner stacks two same-shape matrices, whose row blocks interleave.
    layouts = [placement(f"w{i}", (6, 4), (2,), (0,)) for i in range(4)]
    maps = _maps(layouts, 2, True, budget=1 << 20)
    assert [len(per_rank) for per_rank in maps] == [1, 1]
    assert _decisions(maps) == {(False, False)}


def test_only_the_self_split_changes() -> None:
    """Another rank's sizes never depend on this rank's decision, so none need agreeing."""
    layouts = [placement(f"w{i}", (14, 8), (4,), (0,)) for i in range(6)]
    layouts += [placement(f"e{i}", (2, 5, 4), (4,), (1,), experts=True) for i in range(2)]
    packed, in_place = _maps(layouts, 4, False), _maps(layouts, 4, True)
    for rank in range(4):
        for a, b in zip(packed[rank], in_place[rank], strict=True):
            for name in ("gather_send", "gather_recv", "scatter_send", "scatter_recv"):
                before, after = getattr(a, name).splits, getattr(b, name).splits
                others = [q for q in range(4) if q != rank]
                assert [before[q] for q in others] == [after[q] for q in others], name
                assert before[rank] == 0


def _alltoall(
    sends: list[torch.Tensor], maps: list[BucketMap], direction: str
) -> list[torch.Tensor]:
    """An all-to-all among every rank, by each rank's own splits; checks they agree."""
    world = len(maps)
    send_splits = [getattr(m, f"{direction}_send").splits for m in maps]
    recv_splits = [getattr(m, f"{direction}_recv").splits for m in maps]
    for r in range(world):
        for q in range(world):
            assert send_splits[r][q] == recv_splits[q][r], (direction, r, q)
    parts = [list(s.split_with_sizes(list(send_splits[r]))) for r, s in enumerate(sends)]
    return [torch.cat([parts[q][r] for q in range(world)]) for r in range(world)]


def _simulate(layouts: list[ViewPlacement], world: int, mode: str, budget: int) -> int:
    """Every bucket's gather and scatter among all ranks, each rank laid out in place
    where it decided so, with Newton–Schulz as the identity: every owner must assemble its
    matrices and every holder get back exactly its shard. Returns the in-place buffers."""
    fulls = [
        torch.arange(math.prod(lay.view.shape), dtype=torch.float64).reshape(lay.view.shape)
        for lay in layouts
    ]
    boxes = [local_boxes(lay) for lay in layouts]
    shards = {
        (r, i): fulls[i][tuple(slice(a, b) for a, b in boxes[i][r])]
        for i in range(len(layouts))
        for r in boxes[i]
    }
    written = {key: torch.zeros_like(t) for key, t in shards.items()}
    plans = _plans(layouts, world, mode, budget)
    maps = _maps(layouts, world, True, mode, budget)
    in_place = 0
    for b in range(len(plans[0].buckets)):
        where = [maps[r][b] for r in range(world)]
        sends = []
        for r, m in enumerate(where):
            send = torch.empty(m.gather_send.numel, dtype=torch.float64)
            for out, (view, slices) in zip(
                flat_views(send, m.gather_send.runs), m.gather_reads, strict=True
            ):
                out.copy_(shards[(r, view)][slices])
            sends.append(send)
        received = _alltoall(sends, where, "gather")
        results = []
        for r, m in enumerate(where):
            if m.gather_in_place:
                stacks = stack_views(received[r], m.stacks)
                in_place += 1
            else:
                stacks = [torch.full(s.shape, math.nan, dtype=torch.float64) for s in m.stacks]
                for out, (view, slices) in zip(
                    region_views(stacks, m.own_read_regions), m.own_reads, strict=True
                ):
                    out.copy_(shards[(r, view)][slices])
                for out, piece in zip(
                    region_views(stacks, m.gather_regions),
                    flat_views(received[r], m.gather_recv.runs),
                    strict=True,
                ):
                    out.copy_(piece)
            _check_stacks(plans[r].buckets[b], m, stacks, layouts, fulls)
            results.append(stacks)
        sends = []
        for r, m in enumerate(where):
            for out, (view, slices) in zip(
                region_views(results[r], m.own_write_regions), m.own_writes, strict=True
            ):
                written[(r, view)][slices] += 1
                assert torch.equal(out, shards[(r, view)][slices])
            if m.scatter_in_place:
                (stack,) = results[r]
                sends.append(stack.reshape(-1))
                in_place += 1
                continue
            send = torch.empty(m.scatter_send.numel, dtype=torch.float64)
            for out, piece in zip(
                flat_views(send, m.scatter_send.runs),
                region_views(results[r], m.scatter_regions),
                strict=True,
            ):
                out.copy_(piece)
            sends.append(send)
        for r, (m, buffer) in enumerate(
            zip(where, _alltoall(sends, where, "scatter"), strict=True)
        ):
            for piece, (view, slices) in zip(
                flat_views(buffer, m.scatter_recv.runs), m.scatter_writes, strict=True
            ):
                written[(r, view)][slices] += 1
                assert torch.equal(piece, shards[(r, view)][slices])
    for key, count in written.items():
        assert torch.all(count == 1), f"rank/param {key}: every element written exactly once"
    return in_place


def _check_stacks(
    bucket: BucketPlan,
    where: BucketMap,
    stacks: list[torch.Tensor],
    layouts: list[ViewPlacement],
    fulls: list[torch.Tensor],
) -> None:
    """Each owned block's matrices lie in its stack as the full tensor has them."""
    for spec, stack in zip(where.stacks, stacks, strict=True):
        for index, offset in zip(spec.blocks, spec.offsets, strict=True):
            block = bucket.owned[index]
            box = layouts[block.view].view.box(block.start, block.stop)
            expected = fulls[block.view][tuple(slice(a, b) for a, b in box)]
            got = stack[offset : offset + block.stop - block.start].reshape(block.shape)
            assert torch.equal(got, expected), "an owner assembled a wrong matrix"


def test_simulated_exchange_with_uneven_and_empty_shards() -> None:
    shapes = [(14, 8), (8, 14), (3, 5), (5, 16), (4, 4)] * 2
    for world in (2, 3, 4):
        layouts = [placement(f"w{i}", s, (world,), (0,)) for i, s in enumerate(shapes)]
        layouts.append(placement("e", (3, 6, 4), (world,), (1,), experts=True))
        # A matrix per owner and bucket (in place where it is one), or all in one bucket.
        assert _simulate(layouts, world, "split", 1) > 0
        _simulate(layouts, world, "split", 1 << 20)


@settings(max_examples=60, deadline=None)
@given(RANDOM_LAYOUTS, st.sampled_from(["split", "redundant"]), st.sampled_from([1, 256, 1 << 20]))
def test_random_layouts_exchange_exactly(
    case: tuple[list[ViewPlacement], int], mode: str, budget: int
) -> None:
    layouts, world = case
    _simulate(layouts, world, mode, budget)
