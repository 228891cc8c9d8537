"""Small tensor utilities shared by the state, the step and QK-clip."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


data_ptr = torch._C.TensorBase.data_ptr
"""Where a tensor starts in memory, read past ``__torch_function__`` (no dispatch)."""


def storage(params: Sequence[torch.Tensor]) -> list[int]:
    """Where each parameter's local tensor starts in memory now: a pointer read per
    parameter, so a check every step costs almost nothing."""
    return [data_ptr(p._local_tensor if isinstance(p, DTensor) else p) for p in params]
