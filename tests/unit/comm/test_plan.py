"""The planner, checked without processes: geometry, owners, and a simulated exchange."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from view_placements import placement, random_placements

from muon_dist.comm.groups import Peers
from muon_dist.plan.bucket_map import bucket_map, region_views, stack_specs
from muon_dist.plan.build import (
    BucketPlan,
    OwnedBlock,
    Plan,
    Slices,
    ViewPlacement,
    box_shape,
    build_plan,
    covers_exactly,
    local_boxes,
    local_pieces,
    ns_cost,
    relative_slices,
)
from muon_dist.plan.packing import flat_views, peer_sizes

# 1 to 4 views, stacks of up to 5 experts, up to 4 fused ones.
RANDOM_LAYOUTS = random_placements(max_views=4, max_stack=5, max_fused=4)


def test_local_boxes_follow_torch_chunk() -> None:
    for rows in range(0, 11):
        for world in range(1, 6):
            layout = placement("w", (max(rows, 1), 3), (world,), (0,))
            chunks = torch.arange(max(rows, 1)).chunk(world)
            boxes = local_boxes(layout)
            for r in range(world):
                expected = chunks[r].tolist() if r < len(chunks) else []
                start, stop = boxes[r][0]
                assert list(range(start, stop)) == expected


def _simulate(layouts: list[ViewPlacement], world: int, replica_mode: str = "split") -> list[Plan]:
    """Run every rank's plan against in-memory shards, as the all-to-alls would."""
    plans = [
        build_plan(layouts, r, world, bucket_bytes=4096, itemsize=4, replica_mode=replica_mode)
        for r in range(world)
    ]
    fulls = [
        torch.arange(math.prod(lay.view.shape), dtype=torch.float64).reshape(lay.view.shape)
        for lay in layouts
    ]
    boxes = [local_boxes(lay) for lay in layouts]
    shards = {
        (r, i): fulls[i][tuple(slice(a, b) for a, b in boxes[i][r])].clone()
        for i in range(len(layouts))
        for r in boxes[i]
    }
    written = {key: torch.zeros_like(t) for key, t in shards.items()}
    read = {key: torch.zeros_like(t) for key, t in shards.items()}
    for b in range(len(plans[0].buckets)):
        # Gather: what each rank sends to each peer, in order.
        outbox = defaultdict(list)
        for r, plan in enumerate(plans):
            for piece in plan.buckets[b].gather_sends:
                outbox[(r, piece.peer)].append(shards[(r, piece.view)][piece.slices])
                read[(r, piece.view)][piece.slices] += 1
        results: dict[tuple[int, int], torch.Tensor] = {}
        for r, plan in enumerate(plans):
            bucket = plan.buckets[b]
            assembled = [
                torch.full(ob.shape, float("nan"), dtype=torch.float64) for ob in bucket.owned
            ]
            for index, ob in enumerate(bucket.owned):
                if ob.own_slices is not None:
                    local, inside = ob.own_slices
                    assembled[index][inside] = shards[(r, ob.view)][local]
                    read[(r, ob.view)][local] += 1
            for piece in bucket.gather_recvs:
                chunk = outbox[(piece.peer, r)].pop(0)
                assert chunk.shape == piece.shape
                assembled[piece.block][piece.slices] = chunk
            for index, ob in enumerate(bucket.owned):
                full_box = layouts[ob.view].view.box(ob.start, ob.stop)
                expected = fulls[ob.view][tuple(slice(a, c) for a, c in full_box)]
                assert torch.equal(assembled[index], expected), "owner assembled a wrong matrix"
                assert (ob.stop - ob.start, ob.rows, ob.cols) == (
                    ob.stop - ob.start,
                    layouts[ob.view].view.rows,
                    layouts[ob.view].view.cols,
                )
                results[(r, index)] = assembled[index]
                if ob.own_slices is not None:
                    local, inside = ob.own_slices
                    written[(r, ob.view)][local] += 1
        assert all(not v for v in outbox.values()), "a sent piece was never received"
        # Scatter: results go back to every holder.
        returned = defaultdict(list)
        for r, plan in enumerate(plans):
            for piece in plan.buckets[b].scatter_sends:
                returned[(r, piece.peer)].append(results[(r, piece.block)][piece.slices])
        for r, plan in enumerate(plans):
            for piece in plan.buckets[b].scatter_recvs:
                chunk = returned[(piece.peer, r)].pop(0)
                assert torch.equal(chunk, shards[(r, piece.view)][piece.slices])
                written[(r, piece.view)][piece.slices] += 1
        assert all(not v for v in returned.values()), "a result was never received"
    for key, count in written.items():
        assert torch.all(count == 1), f"rank/param {key}: every element updated exactly once"
    # The optimizer fuses a pass into the reads or writes only where they cover a shard once.
    for r, plan in enumerate(plans):
        reads, writes = local_pieces(plan)
        for i in range(len(layouts)):
            if (r, i) not in shards:
                continue
            shape = shards[(r, i)].shape
            once = bool(torch.all(read[(r, i)] == 1))
            assert covers_exactly(shape, reads.get(i, [])) == once, f"rank {r}, param {i} reads"
            assert covers_exactly(shape, writes.get(i, [])), f"rank {r}, param {i} writes"
    return plans


def test_simulated_exchange_on_mixed_layouts() -> None:
    layouts = [
        placement("a", (3, 40), (4,), (0,)),
        placement("b", (130, 7), (4,), (0,)),
        placement("c", (6, 10, 12), (2, 2), (0, 1), experts=True),
        placement("d", (4 * 5, 9), (2, 2), (None, 0), num_experts=4),
        placement("e", (16, 20), (2, 2), (0, 1)),
        placement("f", (8, 8), (4,), (None,)),
    ]
    for mode in ("split", "redundant"):
        plans = _simulate(layouts, 4, mode)
        assert all(p.blocks == plans[0].blocks for p in plans), "plans differ across ranks"


def test_replicated_work_is_split_not_repeated() -> None:
    layouts = [placement(f"w{i}", (32, 32), (4,), (None,)) for i in range(8)]
    plans = _simulate(layouts, 4)
    owners = defaultdict(int)
    for block in plans[0].blocks:
        owners[block.owner] += block.stop - block.start
    assert dict(owners) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_whole_local_matrices_need_no_communication() -> None:
    layouts = [placement("experts", (8, 16, 12), (4,), (0,), experts=True)]
    plan = build_plan(layouts, 1, 4, bucket_bytes=1 << 20, itemsize=2)
    assert not any(b.communicates for b in plan.buckets)
    assert [(b.start, b.stop) for b in plan.blocks if b.owner == 1] == [(2, 4)]


@settings(max_examples=60, deadline=None)
@given(RANDOM_LAYOUTS, st.sampled_from(["split", "redundant"]))
def test_random_plans_move_every_element_once(
    case: tuple[list[ViewPlacement], int], mode: str
) -> None:
    layouts, world = case
    plans = _simulate(layouts, world, mode)
    assert all(p.blocks == plans[0].blocks for p in plans)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.integers(1, 64), st.integers(1, 6)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 5),
)
def test_owner_loads_within_one_matrix(shapes: list[tuple[int, int, int]], world: int) -> None:
    # Replicated stacks: every rank may own every matrix, the setting LPT's bound is for.
    layouts = [
        placement(f"p{i}", (e, r, c), (world,), (None,), experts=True)
        for i, (r, c, e) in enumerate(shapes)
    ]
    plan = build_plan(layouts, 0, world, bucket_bytes=1 << 30, itemsize=2)
    loads = [plan.load.get(r, 0.0) for r in range(world)]
    largest = max(ns_cost(r, c) for r, c, _ in shapes)
    assert max(loads) - min(loads) <= largest * (1 + 1e-9)


def test_covers_exactly() -> None:
    rows = [(slice(0, 2), slice(0, 4)), (slice(2, 5), slice(0, 4))]
    assert covers_exactly((5, 4), rows)
    assert covers_exactly((5, 4), rows[::-1])
    assert covers_exactly((0, 4), [])
    assert not covers_exactly((5, 4), rows[:1]), "a gap"
    assert not covers_exactly((6, 4), rows), "a gap at the end"
    overlap = [(slice(0, 3), slice(0, 4)), (slice(2, 4), slice(0, 4))]
    assert not covers_exactly((5, 4), overlap), "the sizes add up but two pieces overlap"
    columns = [(slice(0, 5), slice(0, 2)), (slice(0, 5), slice(2, 4))]
    assert covers_exactly((5, 4), columns)
    assert not covers_exactly((5, 4), [(slice(0, 5), slice(0, 2))] * 2), "one piece twice"
    outside = [(slice(0, 5), slice(0, 2)), (slice(0, 5), slice(3, 5))]
    assert not covers_exactly((5, 4), outside), "the sizes add up but one piece leaves the shape"
    assert not covers_exactly((5, 4), [(slice(0, 5),)]), "wrong number of dimensions"


def test_relative_slices_and_shapes() -> None:
    assert relative_slices(((2, 4), (1, 3)), ((2, 6), (0, 5))) == (slice(0, 2), slice(1, 3))
    assert box_shape(((2, 4), (1, 3))) == (2, 2)


def _old_style_views(
    bucket: BucketPlan, stacks: list[torch.Tensor], pieces: list[tuple[int, Slices]]
) -> list[torch.Tensor]:
    """Each piece viewed the plain way: its block's part of the stack, then the slices."""
    layouts = stack_specs(bucket, 0)
    block_views: dict[int, torch.Tensor] = {}
    for layout, stack in zip(layouts, stacks, strict=True):
        for block, offset in zip(layout.blocks, layout.offsets, strict=True):
            owned = bucket.owned[block]
            part = stack[offset : offset + owned.stop - owned.start]
            block_views[block] = part.view(owned.shape)
    return [block_views[block][slices] for block, slices in pieces]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


@settings(max_examples=60, deadline=None)
@given(RANDOM_LAYOUTS, st.sampled_from(["split", "redundant"]))
def test_bucket_layouts_view_every_piece_where_the_plan_puts_it(
    case: tuple[list[ViewPlacement], int], mode: str
) -> None:
    layouts, world = case
    peers = Peers(tuple(range(world)), None)
    for rank in range(world):
        plan = build_plan(layouts, rank, world, bucket_bytes=512, itemsize=4, replica_mode=mode)
        for bucket in plan.buckets:
            layout = bucket_map(bucket, 0, world, peers.ranks)
            stacks = [torch.empty(s.shape) for s in layout.stacks]
            for regions_, pieces in (
                (layout.own_read_regions, [(i, b.own_slices[1]) for i, b in _owned(bucket)]),
                (layout.gather_regions, [(p.block, p.slices) for p in bucket.gather_recvs]),
                (layout.scatter_regions, [(p.block, p.slices) for p in bucket.scatter_sends]),
            ):
                views = region_views(stacks, regions_)
                expected = _old_style_views(bucket, stacks, pieces)
                assert len(views) == len(expected)
                assert all(_same_view(a, b) for a, b in zip(views, expected, strict=True))
            assert (
                layout.own_reads
                == layout.own_writes
                == tuple((b.view, b.own_slices[0]) for _, b in _owned(bucket))
            )
            for packing_, pieces_ in (
                (layout.gather_send, bucket.gather_sends),
                (layout.gather_recv, bucket.gather_recvs),
                (layout.scatter_send, bucket.scatter_sends),
                (layout.scatter_recv, bucket.scatter_recvs),
            ):
                assert list(packing_.splits) == peer_sizes(pieces_, world)
                buffer = torch.empty(packing_.numel)
                views = flat_views(buffer, packing_.runs)
                chunks = buffer.split_with_sizes([math.prod(p.shape) for p in pieces_])
                expected = [c.view(p.shape) for c, p in zip(chunks, pieces_, strict=True)]
                assert len(views) == len(expected)
                assert all(_same_view(a, b) for a, b in zip(views, expected, strict=True))


def _owned(bucket: BucketPlan) -> list[tuple[int, OwnedBlock]]:
    return [(i, b) for i, b in enumerate(bucket.owned) if b.own_slices is not None]


def test_like_pieces_take_one_region_per_stack() -> None:
    # Layers of three shapes, interleaved in parameter order: each owner's blocks of one
    # shape still lie side by side, so each stack's pieces take a single region.
    shapes = [(16, 8), (8, 16), (16, 8), (4, 8)] * 6
    layouts = [placement(f"w{i}", shape, (2,), (0,)) for i, shape in enumerate(shapes)]
    peers = Peers((0, 1), None)
    for rank in range(2):
        plan = build_plan(layouts, rank, 2, bucket_bytes=1 << 20, itemsize=4)
        (bucket,) = plan.buckets
        layout = bucket_map(bucket, 0, 2, peers.ranks)
        assert len(layout.stacks) == 3
        for regions_ in (layout.own_read_regions, layout.gather_regions, layout.scatter_regions):
            assert len(regions_) == 3
        for packing_ in (
            layout.gather_send,
            layout.gather_recv,
            layout.scatter_send,
            layout.scatter_recv,
        ):
            assert len(packing_.runs) == 3
