"""A deliberately plain single-device Muon, written from the algorithm's definition.

Tests compare the optimizer against this: one matrix at a time, no batching, no buckets.
"""

from __future__ import annotations

import math

import torch

from muon_dist.kernels import newton_schulz_torch


def lr_scale(rows: int, cols: int, adjust_lr: str | None) -> float:
    if adjust_lr == "spectral_norm":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def reference_muon_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    adjust_lr: str | None = "spectral_norm",
    ns_steps: int = 5,
    coefficients: str = "quintic",
    matrices: tuple[int, int, int] | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Update ``param`` in place; ``matrices=(count, rows, cols)`` reshapes it (experts)."""
    # fp32 arithmetic throughout: a bf16 multiply would round the scalar itself to bf16.
    momentum_buffer.copy_(momentum_buffer.float() * momentum + grad.float())
    update = torch.add(grad, momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    count, rows, cols = matrices if matrices is not None else (1, *param.shape)
    stack = update.reshape(count, rows, cols)
    ortho = torch.stack(
        [
            newton_schulz_torch(stack[i], steps=ns_steps, coefficients=coefficients, dtype=ns_dtype)
            for i in range(count)
        ]
    )
    param.copy_(param.float() * (1 - lr * weight_decay))
    param.add_(
        ortho.reshape(param.shape).to(param.dtype), alpha=-lr * lr_scale(rows, cols, adjust_lr)
    )
