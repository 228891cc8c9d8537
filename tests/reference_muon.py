"""A deliberately plain single-device Muon, written from the algorithm's definition.

Tests compare the optimizer against this: one parameter at a time, no sharding, no buckets.
"""

from __future__ import annotations

import math

import torch
from reordered_products import ReorderedProducts

from muon_dist.kernels import newton_schulz


def step_with_grads(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    """Give each parameter a copy of its gradient and take one optimizer step."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()


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
    ns_dtype: torch.dtype,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    adjust_lr: str | None = "spectral_norm",
    ns_steps: int = 5,
    coefficients: str = "quintic",
    ns_method: str = "auto",
    matrices: tuple[int, int, int] | None = None,
    magma_score: torch.Tensor | None = None,
    magma_beta: float = 0.9,
    cautious_wd: bool = False,
) -> None:
    """Update ``param`` in place; ``matrices=(count, rows, cols)`` reshapes it (experts).

    ``ns_dtype`` is the Newton–Schulz dtype: float32 to compare exactly, bfloat16 to compare
    within bf16 rounding (parity_cases.BF16_UPDATE), never exactly.

    ``magma_score`` (one entry per matrix, updated in place) turns on Magma-lite damping:
    score = EMA of (1 + cos(momentum, gradient)) / 2, update times 0.1 + 0.9 * score.
    ``cautious_wd`` decays only elements where the update and the weight share a sign.
    """
    # fp32 arithmetic throughout: a bf16 multiply would round the scalar itself to bf16.
    momentum_buffer.copy_(torch.add(grad.float(), momentum_buffer.float(), alpha=momentum))
    update = torch.add(grad, momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    count, rows, cols = matrices if matrices is not None else (1, *param.shape)
    stack = update.reshape(count, rows, cols)
    # One call for the whole stack, as single-device Muon on a 3-D expert weight makes, with
    # its products summed in another order than this machine's kernels (reordered_products).
    with ReorderedProducts():
        ortho = newton_schulz(
            stack,
            steps=ns_steps,
            coefficients=coefficients,
            dtype=ns_dtype,
            backend="torch",
            method=ns_method,
        )
    if magma_score is not None:
        m = momentum_buffer.float().reshape(count, -1)
        g = grad.float().reshape(count, -1)
        cosine = (m * g).sum(1) / (m.norm(dim=1) * g.norm(dim=1)).clamp_min(1e-12)
        score = (1 + cosine.clamp(-1, 1)) / 2
        magma_score.copy_(magma_beta * magma_score + (1 - magma_beta) * score)
        ortho = ortho.float() * (0.1 + 0.9 * magma_score).view(-1, 1, 1)
    ortho = ortho.reshape(param.shape).to(param.dtype)
    if cautious_wd:
        agree = torch.sign(ortho) == torch.sign(param)
        param.sub_(param * agree, alpha=lr * weight_decay)
    else:
        param.copy_(param.float() * (1 - lr * weight_decay))
    param.add_(ortho, alpha=-lr * lr_scale(rows, cols, adjust_lr))
