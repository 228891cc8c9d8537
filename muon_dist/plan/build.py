"""Where every matrix is orthogonalized and how its shards travel: pure functions, no comms.

Each rank calls :func:`build_plan` with the same view placements and gets the same global
decisions (owners, blocks, buckets); :func:`build_plan` then keeps the part that concerns
the calling rank. Geometry follows DTensor's ``torch.chunk`` rule, which FSDP2 uses too, so
uneven and empty shards need no special case.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from muon_dist.plan.indices import ViewIndex
from muon_dist.plan.recipes import StackRecipe
from muon_dist.plan.views import Box, MatrixView

# A piece of a local tensor, as indexed: one slice per dimension, explicit start and stop.
Slices = tuple[slice, ...]

REPLICA_MODES = ("split", "redundant")


@dataclass(frozen=True)
class ViewPlacement:
    """How one matrix view of a Muon parameter lies over ranks (its placement).

    ``shard_dims[i]`` is the tensor dim that mesh dim ``i`` shards, or None where it
    replicates; ``mesh_ranks`` lists the mesh's global ranks in row-major order.
    """

    name: str
    view: MatrixView
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    shard_dims: tuple[int | None, ...]
    recipe: StackRecipe | None = None

    def __post_init__(self) -> None:
        if math.prod(self.mesh_shape) != len(self.mesh_ranks):
            raise ValueError(f"{self.name}: mesh shape {self.mesh_shape} != {self.mesh_ranks}")
        if len(self.shard_dims) != len(self.mesh_shape):
            raise ValueError(f"{self.name}: one placement per mesh dim is needed")


def placement_of(
    param: torch.Tensor,
    name: str,
    view: MatrixView,
    ranks: Sequence[int],
    recipe: StackRecipe | None = None,
) -> ViewPlacement:
    """Read a parameter's mesh and placements; plain tensors count as replicated on ``ranks``."""
    if not isinstance(param, DTensor):
        return ViewPlacement(name, view, (len(ranks),), tuple(ranks), (None,), recipe)
    shard_dims: list[int | None] = []
    for placement in param.placements:
        if type(placement) is Shard:
            shard_dims.append(placement.dim)
        elif isinstance(placement, Replicate):
            shard_dims.append(None)
        else:
            raise ValueError(
                f"parameter {name} has placements {param.placements}: muon_dist supports "
                "Shard(d) and Replicate() only (a Partial value is not a finished gradient "
                "and a strided shard is not a box); redistribute it before the optimizer"
            )
    mesh = param.device_mesh
    return ViewPlacement(
        name,
        view,
        tuple(mesh.shape),
        tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        tuple(shard_dims),
        recipe,
    )


# ---------------------------------------------------------------------------------------
# Box geometry


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def relative_slices(inner: Box, outer: Box) -> Slices:
    """Index ``inner`` inside a tensor that holds exactly ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def _adjacent_on_dim0(a: Box, b: Box) -> bool:
    return a[1:] == b[1:] and a[0][1] == b[0][0]


def mesh_coords(placement: ViewPlacement) -> dict[int, tuple[int, ...]]:
    """Global rank -> coordinate in the parameter's mesh."""
    coords = itertools.product(*(range(s) for s in placement.mesh_shape))
    return dict(zip(placement.mesh_ranks, coords, strict=True))


def local_boxes(placement: ViewPlacement) -> dict[int, Box]:
    """Global rank -> the box of the full parameter its local shard holds (torch.chunk rule)."""
    out: dict[int, Box] = {}
    for rank, coord in mesh_coords(placement).items():
        box = [(0, s) for s in placement.view.shape]
        for mesh_dim, tensor_dim in enumerate(placement.shard_dims):
            if tensor_dim is None:
                continue
            lo, hi = box[tensor_dim]
            chunk = -(-(hi - lo) // placement.mesh_shape[mesh_dim])
            start = min(lo + coord[mesh_dim] * chunk, hi)
            box[tensor_dim] = (start, min(start + chunk, hi))
        out[rank] = tuple(box)
    return out


def local_rows(placement: ViewPlacement, rank: int) -> tuple[int, int]:
    """The dim-0 range of the full parameter in ``rank``'s local shard (empty off its mesh)."""
    box = local_boxes(placement).get(rank)
    return box[0] if box is not None else (0, 0)


# ---------------------------------------------------------------------------------------
# Global decisions


def ns_cost(rows: int, cols: int, steps: int = 5) -> float:
    """Standard FLOP count of Newton–Schulz on one matrix: steps·(4m²n + 2m³), m <= n."""
    m, n = min(rows, cols), max(rows, cols)
    return float(steps) * (4.0 * m * m * n + 2.0 * m**3)


@dataclass
class Block:
    """Consecutive matrices of one parameter, orthogonalized together on one owner."""

    view: ViewIndex
    start: int
    stop: int
    owner: int
    box: Box
    sources: list[tuple[int, Box]]  # (rank, piece) gathered onto the owner
    returns: list[tuple[int, Box]]  # (rank, piece) of the result each holder gets back
    cost: float

    @property
    def crosses_ranks(self) -> bool:
        return any(r != self.owner for r, _ in self.sources + self.returns)


@dataclass
class _Job:
    view: ViewIndex
    matrix: int
    part: tuple[int, ...]
    holders: dict[int, Box]
    candidates: tuple[int, ...]
    cost: float
    owner: int = -1


def _jobs(
    placements: Sequence[ViewPlacement], replica_mode: str, steps_of: Sequence[int]
) -> list[_Job]:
    jobs: list[_Job] = []
    for position, placement in enumerate(placements):
        v_index = ViewIndex(position)
        boxes = local_boxes(placement)
        coords = mesh_coords(placement)
        replica_dims = [i for i, d in enumerate(placement.shard_dims) if d is None]
        view = placement.view
        cost = ns_cost(view.rows, view.cols, steps_of[v_index])
        for matrix in range(view.count):
            mbox = view.box(matrix, matrix + 1)
            parts: dict[tuple[int, ...], dict[int, Box]] = defaultdict(dict)
            for rank, box in boxes.items():
                piece = intersect(box, mbox)
                if piece is None:
                    continue
                key = (
                    tuple(coords[rank][i] for i in replica_dims)
                    if replica_mode == "redundant"
                    else ()
                )
                parts[key][rank] = piece
            for part, holders in sorted(parts.items()):
                jobs.append(_Job(v_index, matrix, part, holders, tuple(sorted(holders)), cost))
    return jobs


def assign_owners(jobs: Sequence[_Job]) -> dict[int, float]:
    """Longest-processing-time-first owners; equal-cost jobs on one candidate set get
    contiguous runs so consecutive matrices of a parameter travel as one block.

    Within each class LPT only depends on how many jobs each candidate takes, so handing out
    contiguous runs of those counts gives exactly LPT's loads: the busiest candidate exceeds
    the lightest by at most the largest single cost. Returns the load per rank.
    """
    load: dict[int, float] = defaultdict(float)
    classes: dict[tuple[float, tuple[int, ...]], list[_Job]] = defaultdict(list)
    for job in jobs:
        classes[(job.cost, job.candidates)].append(job)
    for (cost, candidates), members in sorted(
        classes.items(), key=lambda kv: (-kv[0][0], kv[0][1])
    ):
        heap = [(load[r], r) for r in candidates]
        heapq.heapify(heap)
        counts: dict[int, int] = defaultdict(int)
        for _ in members:
            current, rank = heapq.heappop(heap)
            counts[rank] += 1
            heapq.heappush(heap, (current + cost, rank))
        members.sort(key=lambda j: (j.view, j.part, j.matrix))
        cursor = 0
        for rank in candidates:
            for job in members[cursor : cursor + counts[rank]]:
                job.owner = rank
            cursor += counts[rank]
            load[rank] += cost * counts[rank]
    return dict(load)


def _choose_sources(job: _Job, coords: dict[int, tuple[int, ...]]) -> list[tuple[int, Box]]:
    """One holder per distinct piece: the owner if it has it, else the closest in the mesh."""
    by_piece: dict[Box, list[int]] = defaultdict(list)
    for rank, piece in job.holders.items():
        by_piece[piece].append(rank)
    owner_coord = coords[job.owner]

    def distance(rank: int) -> tuple[int, int]:
        shared = sum(a == b for a, b in zip(coords[rank], owner_coord, strict=True))
        return (-shared, rank)

    return sorted((min(ranks, key=distance), piece) for piece, ranks in by_piece.items())


def _grows(old: list[tuple[int, Box]], new: list[tuple[int, Box]]) -> bool:
    return len(old) == len(new) and all(
        r0 == r1 and _adjacent_on_dim0(b0, b1) for (r0, b0), (r1, b1) in zip(old, new, strict=True)
    )


def _extend(old: list[tuple[int, Box]], new: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    return [(r, ((a[0][0], b[0][1]), *a[1:])) for (r, a), (_, b) in zip(old, new, strict=True)]


def _blocks(
    placements: Sequence[ViewPlacement], jobs: Sequence[_Job], max_block_bytes: int, itemsize: int
) -> list[Block]:
    """Owner-contiguous runs of matrices whose pieces all grow along dim 0 become one block."""
    coords = [mesh_coords(placement) for placement in placements]
    blocks: list[Block] = []
    last_part: tuple[int, ...] | None = None
    for job in sorted(jobs, key=lambda j: (j.view, j.part, j.matrix)):
        view = placements[job.view].view
        sources = _choose_sources(job, coords[job.view])
        returns = sorted((r, piece) for r, piece in job.holders.items() if r != job.owner)
        prev = blocks[-1] if blocks else None
        fits = prev is not None and (
            box_numel(view.box(prev.start, prev.stop + 1)) * itemsize <= max_block_bytes
        )
        if (
            prev is not None
            and fits
            and last_part == job.part
            and (prev.view, prev.stop, prev.owner) == (job.view, job.matrix, job.owner)
            and _grows(prev.sources, sources)
            and _grows(prev.returns, returns)
        ):
            prev.sources = _extend(prev.sources, sources)
            prev.returns = _extend(prev.returns, returns)
            prev.stop += 1
            prev.box = view.box(prev.start, prev.stop)
            prev.cost += job.cost
        else:
            box = view.box(job.matrix, job.matrix + 1)
            blocks.append(
                Block(
                    job.view,
                    job.matrix,
                    job.matrix + 1,
                    job.owner,
                    box,
                    sources,
                    returns,
                    job.cost,
                )
            )
        last_part = job.part
    return blocks


def _buckets(
    blocks: Sequence[Block],
    bucket_bytes: int,
    itemsize: int,
    backward_order: bool = False,
    shares: Sequence[float] | None = None,
) -> list[list[Block]]:
    """Rounds of work: each bucket gives every owner up to ``bucket_bytes`` of its blocks.

    A bucket's collectives involve every rank, so a bucket that only one owner computes in
    would leave the others idle; rounds keep all owners busy at once. Each owner's blocks go
    largest-matrix first, so a round pairs blocks of similar cost across owners (LPT gave
    owners similar counts of each size), and a block larger than the budget forms a round
    slot of its own. With ``backward_order`` each owner's blocks go last view first
    instead, the order in which backward finishes gradients, so the first buckets can
    start while backward still runs. ``shares`` (per view, default 1) is the part of a
    block's elements that travels and is orthogonalized (Dion2's fraction): the budget
    counts those bytes.
    """

    def size(b: Block) -> float:
        return box_numel(b.box) * itemsize * (1.0 if shares is None else shares[b.view])

    def key(b: Block) -> tuple[float, int, int]:
        if backward_order:
            return (-b.view, b.start, 0)
        return (-b.cost / (b.stop - b.start), b.view, b.start)

    queues: dict[int, deque[Block]] = {}
    for block in sorted(blocks, key=key):
        queues.setdefault(block.owner, deque()).append(block)
    buckets: list[list[Block]] = []
    while any(queues.values()):
        bucket: list[Block] = []
        for owner in sorted(queues):
            queue, used = queues[owner], 0.0
            while queue and (used == 0 or used + size(queue[0]) <= bucket_bytes):
                used += size(queue[0])
                bucket.append(queue.popleft())
        buckets.append(bucket)
    return buckets


# ---------------------------------------------------------------------------------------
# What one rank does


@dataclass(frozen=True)
class LocalPiece:
    """A piece of this rank's local shard that is sent to, or received from, ``peer``."""

    peer: int
    view: ViewIndex
    slices: Slices
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BlockPiece:
    """A piece of an owned block that arrives from, or leaves for, ``peer``."""

    peer: int
    block: int
    slices: Slices
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OwnedBlock:
    """A block this rank orthogonalizes; ``own_slices`` maps its own shard into the block."""

    view: ViewIndex
    start: int
    stop: int
    shape: tuple[int, ...]
    rows: int
    cols: int
    recipe: StackRecipe | None
    own_slices: tuple[Slices, Slices] | None  # (local, block)


@dataclass
class BucketPlan:
    """One unit of the step: a gather all-to-all, Newton–Schulz on owned blocks, a scatter.
    ``views`` are the views of all its blocks, on every rank (the same on all ranks)."""

    names: tuple[str, ...]
    views: tuple[ViewIndex, ...] = ()
    blocks: tuple[Block, ...] = ()  # all its blocks, in one order on every rank
    owned: list[OwnedBlock] = field(default_factory=list)
    gather_sends: list[LocalPiece] = field(default_factory=list)
    gather_recvs: list[BlockPiece] = field(default_factory=list)
    scatter_sends: list[BlockPiece] = field(default_factory=list)
    scatter_recvs: list[LocalPiece] = field(default_factory=list)
    communicates: bool = False  # decided globally: every rank agrees


@dataclass
class Plan:
    """The calling rank's share of the step, plus the global loads for inspection."""

    rank: int
    world_size: int
    buckets: list[BucketPlan]
    load: dict[int, float]
    blocks: list[Block]


def local_pieces(plan: Plan) -> tuple[dict[int, list[Slices]], dict[int, list[Slices]]]:
    """Per view, the pieces of this rank's local shard read as Newton–Schulz input, and
    the pieces a result is written to, over the whole step."""
    reads: dict[int, list[Slices]] = defaultdict(list)
    writes: dict[int, list[Slices]] = defaultdict(list)
    for bucket in plan.buckets:
        for block in bucket.owned:
            if block.own_slices is not None:
                reads[block.view].append(block.own_slices[0])
                writes[block.view].append(block.own_slices[0])
        for piece in bucket.gather_sends:
            reads[piece.view].append(piece.slices)
        for piece in bucket.scatter_recvs:
            writes[piece.view].append(piece.slices)
    return reads, writes


def is_whole(slices: Slices, shape: Sequence[int]) -> bool:
    """Whether ``slices`` index all of a tensor of ``shape`` (the tensor itself serves)."""
    return all((s.start, s.stop) == (0, n) for s, n in zip(slices, shape, strict=True))


def covers_exactly(shape: Sequence[int], pieces: Sequence[Slices]) -> bool:
    """Whether ``pieces`` tile a tensor of ``shape``: every element lies in exactly one."""
    boxes = sorted(tuple((s.start, s.stop) for s in piece) for piece in pieces)
    inside = all(
        len(box) == len(shape)
        and all(0 <= lo < hi <= size for (lo, hi), size in zip(box, shape, strict=True))
        for box in boxes
    )
    if not inside or sum(box_numel(box) for box in boxes) != math.prod(shape):
        return False
    for index, box in enumerate(boxes):
        for later in boxes[index + 1 :]:
            if later[0][0] >= box[0][1]:
                break  # sorted by first row: no later box reaches back into this one
            if intersect(box, later) is not None:
                return False
    return True


def _rank_bucket(
    bucket: Sequence[Block],
    placements: Sequence[ViewPlacement],
    rank: int,
    boxes: Sequence[dict[int, Box]],
) -> BucketPlan:
    plan = BucketPlan(
        names=tuple(sorted({placements[b.view].name for b in bucket})),
        views=tuple(sorted({b.view for b in bucket})),
        blocks=tuple(bucket),
        communicates=any(b.crosses_ranks for b in bucket),
    )
    for block in bucket:
        mine = boxes[block.view].get(rank)
        if block.owner == rank:
            _own(plan, block, placements[block.view], rank, mine)
        elif mine is not None:  # a rank holding nothing of the parameter moves no pieces
            _hold(plan, block, rank, mine)
    # Pack per peer; the stable sort keeps block order, which sender and receiver share.
    for pieces in (plan.gather_sends, plan.gather_recvs, plan.scatter_sends, plan.scatter_recvs):
        pieces.sort(key=lambda p: p.peer)
    return plan


def _own(
    plan: BucketPlan, block: Block, placement: ViewPlacement, rank: int, mine: Box | None
) -> None:
    """Add a block this rank owns: the pieces it gathers from and returns to the others."""
    index = len(plan.owned)
    own = intersect(mine, block.box) if mine is not None else None
    own_slices = None
    if own and mine is not None:
        own_slices = (relative_slices(own, mine), relative_slices(own, block.box))
    view = placement.view
    plan.owned.append(
        OwnedBlock(
            block.view,
            block.start,
            block.stop,
            box_shape(block.box),
            view.rows,
            view.cols,
            placement.recipe,
            own_slices,
        )
    )
    for src, piece in block.sources:
        if src != rank:
            plan.gather_recvs.append(
                BlockPiece(src, index, relative_slices(piece, block.box), box_shape(piece))
            )
    for dst, piece in block.returns:
        plan.scatter_sends.append(
            BlockPiece(dst, index, relative_slices(piece, block.box), box_shape(piece))
        )


def _hold(plan: BucketPlan, block: Block, rank: int, mine: Box) -> None:
    """Add a block another rank owns: the pieces of it this rank sends and gets back."""
    for src, piece in block.sources:
        if src == rank:
            plan.gather_sends.append(
                LocalPiece(block.owner, block.view, relative_slices(piece, mine), box_shape(piece))
            )
    for dst, piece in block.returns:
        if dst == rank:
            plan.scatter_recvs.append(
                LocalPiece(block.owner, block.view, relative_slices(piece, mine), box_shape(piece))
            )


def _by_stack(bucket: Sequence[Block], placements: Sequence[ViewPlacement]) -> list[Block]:
    """Each owner's blocks of a bucket with those of one stack (same matrix shape and
    Newton–Schulz schedule) next to each other, stacks in the order they first appear.

    The order inside a stack is kept, so the stacks are the same; the pieces of a stack then
    lie side by side in the exchange buffers, where a step takes one view for all of them.
    """
    first: dict[tuple[int, int, int, StackRecipe | None], int] = {}
    keys = []
    for block in bucket:
        placement = placements[block.view]
        stack = (block.owner, placement.view.rows, placement.view.cols, placement.recipe)
        keys.append((block.owner, first.setdefault(stack, len(first))))
    order = sorted(range(len(bucket)), key=keys.__getitem__)
    return [bucket[i] for i in order]


def build_plan(
    placements: Sequence[ViewPlacement],
    rank: int,
    world_size: int,
    *,
    bucket_bytes: int,
    itemsize: int,
    replica_mode: str = "split",
    steps: Sequence[int] | None = None,
    backward_order: bool = False,
    shares: Sequence[float] | None = None,
) -> Plan:
    """Decide owners, blocks and buckets for all placements, and keep ``rank``'s share;
    ``backward_order`` orders the buckets last view first, ``shares`` weighs each view's
    bytes in the bucket budget (see :func:`_buckets`)."""
    if replica_mode not in REPLICA_MODES:
        raise ValueError(f"replica_mode={replica_mode!r}; choose one of {list(REPLICA_MODES)}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    steps_of = list(steps) if steps is not None else [5] * len(placements)
    jobs = _jobs(placements, replica_mode, steps_of)
    load = assign_owners(jobs)
    blocks = _blocks(placements, jobs, bucket_bytes, itemsize)
    boxes = [local_boxes(placement) for placement in placements]
    buckets = [
        _rank_bucket(_by_stack(bucket, placements), placements, rank, boxes)
        for bucket in _buckets(blocks, bucket_bytes, itemsize, backward_order, shares)
    ]
    return Plan(rank, world_size, buckets, load, blocks)
