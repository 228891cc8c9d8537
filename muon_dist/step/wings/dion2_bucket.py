"""One bucket holding Dion2 matrices as a generator task: only the selected slices travel.

Norms, choose, gather, orthogonalize, scatter, apply: every rank adds its source pieces'
partial slice norms (float64) into the bucket's norm vector and one all-reduce sums them;
every rank then takes the same top slices (:func:`muon_dist.rules.dion2_slices.top_slices`), so
the choice is exact and independent of the layout. One host copy of the choice per bucket
sizes both exchanges (:mod:`muon_dist.plan.dion2_selection`); each moves the selected elements only.
The owner orthogonalizes exactly the slices chosen; a holder writes its piece's update with
zeros in the slices left out, the form the plain bucket hands over.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from muon_dist.comm.dion2_exchange import exchange_rects, put_all
from muon_dist.comm.exchange import Exchanges, Fill, ScatterSteps, Steps, pack
from muon_dist.comm.groups import dedicated
from muon_dist.kernels.streams import side_stream
from muon_dist.kernels.tables import PinnedStaging
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap
from muon_dist.plan.build import BucketPlan, Plan
from muon_dist.plan.dion2_selection import (
    BucketSelection,
    HostRect,
    Rect,
    device_rects,
    rect_indices,
    take,
)
from muon_dist.plan.packing import flat_views
from muon_dist.plan.views import Box, MatrixView, PartSplit
from muon_dist.rules.dion2_slices import add_slice_norms_, top_slices
from muon_dist.runtime.scheduler import Task
from muon_dist.step.bucket.bucket_io import BucketTools
from muon_dist.step.bucket.bucket_task import run_bucket


class DeviceSelection:
    """A bucket's selection layout with its fixed index tensors on the device (copied on
    the first step, kept for the plan), and the pinned buffer its step's indices go
    through."""

    def __init__(self, selection: BucketSelection, device: torch.device) -> None:
        self.host = selection
        self.device = device
        self.send_tiles = [_tiles_to(selection.tiles(p), device) for p in selection.gather_sends]
        self.own_tiles = [_tiles_to(selection.tiles(p), device) for p in selection.own]
        self.stack_chosen = {
            stack: [index.to(device) for index in parts]
            for stack, parts in selection.stack_chosen.items()
        }
        self._staging = PinnedStaging()

    def rects_to(self, rects: Sequence[Sequence[HostRect]]) -> list[list[Rect]]:
        """The step's rectangles on the device, in one copy through a pinned buffer reused
        every step."""
        flat = rect_indices(rects)
        if self.device.type != "cuda":
            return device_rects(rects, torch.from_numpy(flat))
        return device_rects(rects, self._staging.upload(flat, self.device))


def _tiles_to(
    tiles: Sequence[tuple[HostRect, int, np.ndarray]], device: torch.device
) -> list[tuple[Rect, int, torch.Tensor]]:
    rects = [[rect for rect, _, _ in tiles]]
    moved = device_rects(rects, torch.from_numpy(rect_indices(rects)).to(device))[0]
    return [
        (rect, axis, torch.from_numpy(slots).to(device))
        for rect, (_, axis, slots) in zip(moved, tiles, strict=True)
    ]


def selected_buckets(
    plan: Plan, selects: Collection[int], ranks: Sequence[int], settings: ExecutionSettings
) -> frozenset[int]:
    """The buckets that move only the selected slices: those that exchange and hold a view
    of ``selects`` owned among ``ranks``, unless the step is captured (a captured step's
    exchange sizes are fixed)."""
    return frozenset(
        index
        for index, bucket in enumerate(plan.buckets)
        if bucket.communicates
        and not settings.cuda_graph
        and any(b.view in selects and b.owner in ranks for b in bucket.blocks)
    )


class Dion2Buckets:
    """Dion2's side of a phase: which buckets move only the selected slices (``selected``,
    from :func:`selected_buckets`), each bucket's selection layout (made on its first step),
    and the norms' own communicator and stream, so that neither waits behind the
    all-to-alls and a bucket's host copy of its choice waits for nothing else."""

    def __init__(
        self,
        plan: Plan,
        maps: Sequence[BucketMap],
        views: Sequence[MatrixView],
        selects: dict[int, tuple[float, PartSplit | None]],
        selected: frozenset[int],
        local_box: Callable[[int], Box],
        exchanges: Exchanges,
        settings: ExecutionSettings,
    ) -> None:
        self._plan, self._maps, self._views = plan, maps, views
        self._selects, self._local_box = selects, local_box
        self._exchanges = exchanges
        self.backend = settings.backend
        self.selected = selected
        self._layouts: dict[int, DeviceSelection] = {}
        peers = exchanges.peers
        self.norm_peers = dedicated(peers, "dion2 norms") if self.selected else peers
        self.stream: torch.cuda.Stream | None = None
        if self.selected and exchanges.device.type == "cuda":
            self.stream = side_stream(exchanges.device, "dion2 choice")

    def layout(self, index: int) -> DeviceSelection:
        """Bucket ``index``'s selection layout, laid out on its first step."""
        found = self._layouts.get(index)
        if found is None:
            found = self._layouts[index] = DeviceSelection(
                BucketSelection(
                    self._plan.buckets[index],
                    self._plan.rank,
                    self._exchanges.peers.ranks,
                    self._views,
                    self._selects,
                    self._local_box,
                    self._maps[index].stacks,
                ),
                self._exchanges.device,
            )
        return found


def selected_bucket_task(
    bucket: BucketPlan, index: int, where: BucketMap, tools: BucketTools, dion2: Dion2Buckets
) -> Task:
    """Wrap one communicating bucket with Dion2 matrices as a task; it yields once per
    exchange or host copy it waits on. ``index`` is its position in the plan.

    Its norms and choice run on the selection stream, after only the work queued before
    the task was made (the step's momentum and gradients, or a hook's); that stream, not
    the host, waits for the norms' all-reduce."""
    exchange = SelectedExchange(where, dion2.layout(index), tools.exchanges, dion2)
    return Task(bucket.names, run_bucket(where, tools, exchange))


class SelectedExchange:
    """Dion2's transport (:class:`muon_dist.comm.exchange.BucketExchange`): before the
    gather, the bucket's slice norms, summed over the peers, and the same choice on every
    rank; then each piece moves only its elements in the chosen slices."""

    def __init__(
        self, where: BucketMap, layout: DeviceSelection, exchanges: Exchanges, dion2: Dion2Buckets
    ) -> None:
        self._where, self._layout, self._exchanges, self._dion2 = where, layout, exchanges, dion2
        self._made = _event(dion2.stream)  # the work queued before the task was made
        self._chosen: torch.Tensor | None = None  # set by the gather
        self._moves: tuple[list[list[Rect]], ...] = ()

    def gather(self, read: Fill, own: Callable[[list[torch.Tensor]], object]) -> Steps:
        where, layout, exchanges, dion2 = self._where, self._layout, self._exchanges, self._dion2
        sel = layout.host
        with _on(dion2.stream, self._made):
            staged, inputs, stacks = _stage(where, layout, exchanges, read, own)
            planes = [stack.view(-1, stack.shape[-1]) for stack in stacks]
            chosen = _choose(layout, inputs, planes, dion2, exchanges.device)
            host, chosen_ready = _to_host(chosen)
        yield
        if chosen_ready is not None:  # the side stream's work for this bucket is done
            chosen_ready.synchronize()
            _hand_over(chosen_ready, [staged, chosen, *stacks])
        self._chosen = chosen
        self._moves = gather_sends, gather_recvs, _, _ = _moves(layout, host.numpy())
        recv, work = exchange_rects(
            inputs, sel.gather_sends, gather_sends, sel.gather_recvs, gather_recvs, exchanges
        )
        del staged, inputs
        yield
        _wait(work)
        put_all([planes[p.stack] for p in sel.gather_recvs], gather_recvs, recv)
        return stacks

    def chosen(self, position: int) -> list[torch.Tensor] | None:
        parts = self._layout.stack_chosen.get(position)
        if parts is None or self._chosen is None:
            return None
        return [self._chosen[index] for index in parts]

    def scatter(self, results: list[torch.Tensor]) -> ScatterSteps:
        where, sel, exchanges = self._where, self._layout.host, self._exchanges
        _, _, scatter_sends, scatter_recvs = self._moves
        outputs = [r.view(-1, r.shape[-1]) for r in results]
        recv, work = exchange_rects(
            [outputs[p.stack] for p in sel.scatter_sends],
            sel.scatter_sends,
            scatter_sends,
            sel.scatter_recvs,
            scatter_recvs,
            exchanges,
        )
        results.clear()
        del outputs
        yield
        _wait(work)
        updates = torch.zeros(
            where.scatter_recv.numel, dtype=exchanges.dtype, device=exchanges.device
        )
        pieces = flat_views(updates, where.scatter_recv.runs)
        grids = zip(pieces, sel.scatter_recvs, strict=True)
        put_all([v.view(len(p.rows), len(p.cols)) for v, p in grids], scatter_recvs, recv)
        return pieces


def _stage(
    where: BucketMap,
    layout: DeviceSelection,
    exchanges: Exchanges,
    read: Fill,
    own: Callable[[list[torch.Tensor]], object],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The Newton–Schulz inputs this rank sends (packed, and each as ``[rows, cols]``) and
    the owner's stacks with its own pieces in place."""
    dtype, device = exchanges.dtype, exchanges.device
    staged = pack(where.gather_send, read, dtype, device)
    inputs = [
        view.view(len(p.rows), len(p.cols))
        for view, p in zip(
            flat_views(staged, where.gather_send.runs), layout.host.gather_sends, strict=True
        )
    ]
    stacks = [torch.zeros(s.shape, dtype=dtype, device=device) for s in where.stacks]
    own(stacks)
    return staged, inputs, stacks


def _choose(
    layout: DeviceSelection,
    inputs: Sequence[torch.Tensor],
    planes: Sequence[torch.Tensor],
    dion2: Dion2Buckets,
    device: torch.device,
) -> torch.Tensor:
    """The bucket's chosen slices: partial norms of this rank's pieces, summed over the
    exchange peers, and the same top slices on every rank."""
    sel = layout.host
    # On ``device``: a rank holding nothing of the bucket has neither inputs nor planes.
    norms = torch.zeros(sel.slots, dtype=torch.float64, device=device)
    sources = [*zip(inputs, layout.send_tiles, strict=True)]
    sources += [
        (planes[piece.stack], tiles) for piece, tiles in zip(sel.own, layout.own_tiles, strict=True)
    ]
    add_norms(norms, sources, dion2.backend)
    # The choice follows at once on this stream (which waits for the all-reduce, the host
    # does not): queued after the next buckets' staging, it would wait for them.
    _wait(dist.all_reduce(norms, group=dion2.norm_peers.group, async_op=True))
    chosen = torch.empty(sel.chosen_count, dtype=torch.long, device=device)
    for slot, n, length, count, first in sel.batches:
        top = top_slices(norms[slot : slot + n * length].view(n, length), count)
        chosen[first : first + n * count].view(n, count).copy_(top)
    return chosen


def _moves(
    layout: DeviceSelection, choice: np.ndarray
) -> tuple[list[list[Rect]], list[list[Rect]], list[list[Rect]], list[list[Rect]]]:
    """Each piece's rectangles of selected elements for this step's ``choice``: the
    gather's sends and receives, the scatter's sends and receives."""
    sel = layout.host
    lists = (sel.gather_sends, sel.gather_recvs, sel.scatter_sends, sel.scatter_recvs)
    moves = iter(layout.rects_to([sel.rects(p, choice) for pieces in lists for p in pieces]))
    gather_sends, gather_recvs, scatter_sends, scatter_recvs = (
        [next(moves) for _ in pieces] for pieces in lists
    )
    return gather_sends, gather_recvs, scatter_sends, scatter_recvs


def _event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded now on the current stream, where a side stream is to wait on it."""
    if stream is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


@contextmanager
def _on(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> Iterator[None]:
    """Run the block on ``stream`` (when there is one) once ``after`` has happened."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield


def _hand_over(done: torch.cuda.Event, tensors: Sequence[torch.Tensor]) -> None:
    """The current stream takes over ``tensors``, made on the side stream up to ``done``."""
    stream = torch.cuda.current_stream()
    stream.wait_event(done)
    for tensor in tensors:
        tensor.record_stream(stream)


def add_norms(
    norms: torch.Tensor,
    sources: Sequence[tuple[torch.Tensor, Sequence[tuple[Rect, int, torch.Tensor]]]],
    backend: str,
) -> None:
    """Add the slice norms (L1, float64) of each source's tiles at their slots, in one
    pass over all of them."""
    xs, axes, slots = [], [], []
    for x, tiles in sources:
        for rect, axis, where in tiles:
            xs.append(take(x, rect).view(rect.shape))
            axes.append(-2 if axis == 0 else -1)
            slots.append(where)
    add_slice_norms_(norms, xs, axes, slots, backend)


def _to_host(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying the choice to pinned host memory; the event (None off CUDA, where
    the copy is done on return) marks its arrival on the stream it was queued on."""
    if chosen.device.type != "cuda":
        return chosen.cpu(), None
    host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
    host.copy_(chosen, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return host, event


def _wait(work: dist.Work | None) -> None:
    if work is None:
        raise RuntimeError("an asynchronous collective returned no work handle")
    work.wait()
