"""Small tensor utilities shared by the plan, the state and the step."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
