"""The packed all-to-all exchange of a bucket's pieces: one collective per bucket and direction
(the buffers' layout is :mod:`muon_dist.plan.packing`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from muon_dist.comm.groups import Peers
from muon_dist.plan.packing import Packing, flat_views


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
