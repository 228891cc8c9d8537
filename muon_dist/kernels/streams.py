"""Side streams, one per device and use, shared by the process.

torch keeps a cuBLAS workspace for every stream a matmul ran on, for as long as the process
lives (32 MiB each on Hopper): a stream created per optimizer, per rebuilt step or per graph
capture would leave one behind each time. The optimizer's side streams are therefore made
once per device and use and shared, so creating and deleting optimizers keeps nothing.
"""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, use: str) -> torch.cuda.Stream:
    """The process's side stream for ``use`` on CUDA ``device``."""
    key = (
        torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index),
        use,
    )
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(key[0])  # type: ignore[no-untyped-call]
    return stream
