"""A bucket's transport: the gather of Newton–Schulz inputs to their owners and the scatter
of results back, one all-to-all per bucket and direction, behind one object
(:class:`BucketExchange`). :class:`PackedExchange` moves whole pieces in packed buffers
(their layout is :mod:`muon_dist.plan.packing`); Dion2's variant moves only the chosen
slices (:class:`muon_dist.comm.dion2_exchange.SelectedExchange`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from muon_dist.comm.groups import Peers
from muon_dist.plan.bucket_map import BucketMap, region_views, stack_views
from muon_dist.plan.packing import Packing, flat_views

# Writes the pieces' values into the views it is handed (all at once, so it can batch).
Fill = Callable[[list[torch.Tensor]], object]
# A generator step of a bucket task: it yields while a collective is in flight.
Steps = Generator[None, None, list[torch.Tensor]]
# A scatter's steps: None where the bucket does not communicate (nothing is received).
ScatterSteps = Generator[None, None, list[torch.Tensor] | None]


@dataclass(frozen=True)
class Exchanges:
    """How this rank's bucket all-to-alls run: among ``peers``, in ``dtype``, on ``device``
    (``world_size`` ranks in all)."""

    peers: Peers
    dtype: torch.dtype
    device: torch.device
    world_size: int


class BucketExchange(Protocol):
    """One bucket's transport, in two steps a task runs with ``yield from``."""

    def gather(self, read: Fill, own: Callable[[list[torch.Tensor]], object]) -> Steps:
        """The owner's Newton–Schulz input stacks: the pieces this rank sends read by
        ``read`` into the send buffer, its own pieces read by ``own`` into the stacks (or
        sent to itself, where the receive buffer is the stacks), the received ones put in
        place."""
        ...

    def scatter(self, results: list[torch.Tensor]) -> ScatterSteps:
        """Send the results' pieces back (``results`` is emptied once they are packed, so a
        waiting task holds no stacks) and return this rank's received pieces' updates, in
        the order of the bucket map's ``scatter_writes`` (None: the bucket does not
        communicate)."""
        ...


def pack(
    layout: Packing,
    fill: Callable[[list[torch.Tensor]], object],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One flat buffer of ``dtype``; ``fill`` gets every piece's view at once, so it can
    write them with a few batched launches rather than one per piece."""
    buffer = torch.empty(layout.numel, dtype=dtype, device=device)
    fill(flat_views(buffer, layout.runs))
    return buffer


def start_exchange(
    send: torch.Tensor, sends: Sequence[int], recvs: Sequence[int], peers: Peers
) -> tuple[torch.Tensor, dist.Work]:
    """Issue the asynchronous all-to-all among ``peers``, ``sends[i]`` elements to and
    ``recvs[i]`` from its i-th rank; the caller waits on the work."""
    recv = torch.empty(sum(recvs), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=list(recvs),
        input_split_sizes=list(sends),
        group=peers.group,
        async_op=True,
    )
    if work is None:
        raise RuntimeError("all_to_all_single(async_op=True) returned no work handle")
    return recv, work


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, in one foreach launch where it can."""
    if targets:
        torch._foreach_copy_(targets, sources)


class PackedExchange:
    """Whole pieces in packed buffers, laid out once per plan by the bucket map ``where``;
    a bucket that does not ``communicate`` only reads its own pieces. Where the map says
    so, the receive buffer is the stacks and the result stack the send buffer, own pieces
    included (:mod:`muon_dist.plan.in_place`): nothing is copied in or packed."""

    def __init__(self, where: BucketMap, communicates: bool, exchanges: Exchanges) -> None:
        self._where, self._communicates, self._exchanges = where, communicates, exchanges

    def _start(self, sends: Packing, recvs: Packing, fill: Fill) -> tuple[torch.Tensor, dist.Work]:
        """Pack the pieces this rank sends and start the all-to-all; returns the receive
        buffer (the send buffer is dropped here: the collective keeps its own reference)."""
        x = self._exchanges
        send = pack(sends, fill, x.dtype, x.device)
        return start_exchange(send, sends.splits, recvs.splits, x.peers)

    def gather(self, read: Fill, own: Callable[[list[torch.Tensor]], object]) -> Steps:
        where, x = self._where, self._exchanges
        received = None
        if self._communicates:
            received, work = self._start(where.gather_send, where.gather_recv, read)
            yield
            work.wait()
            if where.gather_in_place:  # own pieces came in the send buffer's self split
                return stack_views(received, where.stacks)
        stacks = [torch.empty(s.shape, dtype=x.dtype, device=x.device) for s in where.stacks]
        own(stacks)
        if received is not None:
            copy_all(
                region_views(stacks, where.gather_regions),
                flat_views(received, where.gather_recv.runs),
            )
        return stacks

    def scatter(self, results: list[torch.Tensor]) -> ScatterSteps:
        where, x = self._where, self._exchanges
        if not self._communicates:
            results.clear()
            return None
        if where.scatter_in_place:
            (result,) = results
            # A copy only where Newton–Schulz handed the stack back in another dtype or
            # transposed; the collective keeps its own reference to the buffer.
            send = result.to(x.dtype, memory_format=torch.contiguous_format).view(-1)
            received, work = start_exchange(
                send, where.scatter_send.splits, where.scatter_recv.splits, x.peers
            )
            del result, send
        else:
            received, work = self._start(
                where.scatter_send,
                where.scatter_recv,
                lambda outs: copy_all(outs, region_views(results, where.scatter_regions)),
            )
        results.clear()
        yield
        work.wait()
        return flat_views(received, where.scatter_recv.runs)
