"""Dion2's selected exchange, the transport half: only the elements of the chosen slices
travel, as each piece's rectangles of this step (:class:`muon_dist.plan.dion2_selection.Rect`),
written in order into one send buffer and put back from the receive buffer.

:class:`SelectedExchange` is a bucket's transport (:class:`muon_dist.comm.exchange.BucketExchange`):
it stages the pieces, asks its :class:`Choice` (the rule's side,
:mod:`muon_dist.step.wings.dion2`) which slices travel, copies that choice to the host once
(it sizes both exchanges, :mod:`muon_dist.plan.dion2_selection`), and moves only those
elements. A holder receives its piece's update with zeros in the slices left out, the form
the packed exchange hands over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from muon_dist.comm.exchange import Exchanges, Fill, ScatterSteps, Steps, pack, start_exchange
from muon_dist.kernels.tables import PinnedStaging
from muon_dist.plan.bucket_map import BucketMap
from muon_dist.plan.dion2_selection import (
    BucketSelection,
    HostRect,
    PieceGrid,
    Rect,
    device_rects,
    put_,
    rect_indices,
    take_into,
)
from muon_dist.plan.packing import flat_views, peer_splits


class Choice(Protocol):
    """The rule's side of a selected exchange: which slices travel, chosen on ``stream``
    (None: the current one), and where the owner finds them."""

    stream: torch.cuda.Stream | None

    def choose(
        self,
        layout: DeviceSelection,
        inputs: Sequence[torch.Tensor],
        planes: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The bucket's chosen slices (their indices, the same on every rank) from the
        pieces this rank sends (``inputs``) and its stacks' rows (``planes``)."""
        ...

    def keep(self, where: BucketMap, layout: DeviceSelection, chosen: torch.Tensor) -> None:
        """Leave the chosen slices of each of the bucket's stacks for its owner part."""
        ...


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


class SelectedExchange:
    """Dion2's transport (:class:`muon_dist.comm.exchange.BucketExchange`): before the
    gather, the bucket's slice norms, summed over the peers, and the same choice on every
    rank; then each piece moves only its elements in the chosen slices."""

    def __init__(
        self, where: BucketMap, layout: DeviceSelection, exchanges: Exchanges, choice: Choice
    ) -> None:
        self._where, self._layout, self._exchanges, self._choice = where, layout, exchanges, choice
        # The work queued before the task was made (the step's momentum and gradients, or a
        # hook's): the norms and choice run on the selection stream after it, and that
        # stream, not the host, waits for the norms' all-reduce.
        self._made = _event(choice.stream)
        self._moves: tuple[list[list[Rect]], ...] = ()

    def gather(self, read: Fill, own: Callable[[list[torch.Tensor]], object]) -> Steps:
        where, layout, exchanges, choice = self._where, self._layout, self._exchanges, self._choice
        sel = layout.host
        with _on(choice.stream, self._made):
            staged, inputs, stacks = _stage(where, layout, exchanges, read, own)
            planes = [stack.view(-1, stack.shape[-1]) for stack in stacks]
            chosen = choice.choose(layout, inputs, planes)
            host, chosen_ready = _to_host(chosen)
        yield
        if chosen_ready is not None:  # the side stream's work for this bucket is done
            chosen_ready.synchronize()
            _hand_over(chosen_ready, [staged, chosen, *stacks])
        choice.keep(where, layout, chosen)
        self._moves = gather_sends, gather_recvs, _, _ = _moves(layout, host.numpy())
        recv, work = exchange_rects(
            inputs, sel.gather_sends, gather_sends, sel.gather_recvs, gather_recvs, exchanges
        )
        del staged, inputs
        yield
        wait_for(work)
        put_all([planes[p.stack] for p in sel.gather_recvs], gather_recvs, recv)
        return stacks

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
        wait_for(work)
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


def wait_for(work: dist.Work | None) -> None:
    """Wait for an asynchronous collective's ``work``."""
    if work is None:
        raise RuntimeError("an asynchronous collective returned no work handle")
    work.wait()


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
