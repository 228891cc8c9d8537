"""Parameters whose storage was replaced after the step was built, and their state moved.

The step binds views of each parameter's local tensor once (:mod:`muon_dist.step.shard.piece_io`).
``p.data = ...``, ``module.to(torch.bfloat16)`` or FSDP2's own resets give a parameter new
storage; the bound views would keep updating the old one while the model reads the new,
so the step looks at where each local tensor lives (a pointer per parameter, no device
work) and rebuilds when one moved, as torch's optimizers, which bind nothing, in effect do.
A parameter whose dtype or device changed takes its state along, cast and moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from muon_dist.state.group_state import FP32_TENSORS, momenta_like, momentum_dtype
from muon_dist.state.tensors import local


def _dtype_of(group: dict[str, Any], p: torch.Tensor, key: str) -> torch.dtype:
    """The dtype the state tensor ``key`` of ``p`` is kept in (not one of FP32_TENSORS)."""
    return momentum_dtype(group, p) if key == "momentum_buffer" else local(p).dtype


def follow_params(groups: Sequence[dict[str, Any]], state: dict[torch.Tensor, Any]) -> None:
    """Move the state of every parameter whose dtype or device changed to its new dtype and
    device (a momentum to its :func:`momentum_dtype`); a group's momenta stay views of one
    buffer (see :mod:`muon_dist.state.flat`)."""
    for group in groups:
        params = group["params"]
        moved = [
            p
            for p in params
            if any(
                isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and (local(v).dtype, local(v).device) != (_dtype_of(group, p, k), local(p).device)
                for k, v in state[p].items()
                if k not in FP32_TENSORS
            )
            or any(
                local(v).device != local(p).device
                for v in state[p].values()
                if isinstance(v, torch.Tensor)
            )
        ]
        if not moved:
            continue
        if group["algorithm"] == "muon":
            momenta = momenta_like(group)
            for p, momentum in zip(params, momenta, strict=True):
                local(momentum).copy_(local(state[p]["momentum_buffer"]))
                state[p]["momentum_buffer"] = momentum
                for key in FP32_TENSORS:
                    if key in state[p]:
                        state[p][key] = state[p][key].to(local(p).device)
            continue
        for p in moved:
            for key in ("exp_avg", "exp_avg_sq"):
                fresh = torch.zeros_like(p)
                local(fresh).copy_(local(state[p][key]))
                state[p][key] = fresh
            state[p]["step"] = state[p]["step"].to(local(p).device)
