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
    row_moment: torch.Tensor | None = None,
    normuon_beta2: float = 0.95,
    normuon_eps: float = 1e-8,
    dion2_fraction: float | None = None,
) -> None:
    """Update ``param`` in place; ``matrices=(count, rows, cols)`` reshapes it (experts).

    ``ns_dtype`` is the Newton–Schulz dtype: float32 to compare exactly, bfloat16 to compare
    within bf16 rounding (parity_cases.BF16_UPDATE), never exactly.

    ``magma_score`` (one entry per matrix, updated in place) turns on Magma-lite damping:
    score = EMA of (1 + cos(momentum, gradient)) / 2, update times 0.1 + 0.9 * score.
    ``cautious_wd`` decays only elements where the update and the weight share a sign.
    ``row_moment`` (one entry per row of each matrix, updated in place) turns on NorMuon
    (Li et al. 2025): v = beta2 * v + (1 - beta2) * mean over columns of O^2, the update
    O / (sqrt(v) + eps) rescaled to the Frobenius norm of O.
    ``dion2_fraction`` turns on Dion2: the gradient is added to the momentum without decay;
    of each matrix's slices along its shorter side (rows on a tie), the ceil(fraction * L)
    with the largest L1 norms of the Newton–Schulz input (ties: lower index) are
    orthogonalized as one submatrix, the rest of the update is zero, and only the selected
    slices' momentum decays by ``momentum``.
    """
    if dion2_fraction is not None:
        _dion2_step(
            param,
            grad,
            momentum_buffer,
            dion2_fraction,
            lr,
            ns_dtype,
            momentum,
            nesterov,
            weight_decay,
            adjust_lr,
            ns_steps,
            coefficients,
            ns_method,
            matrices,
        )
        return
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
    if row_moment is not None:
        o = ortho.float()
        v = row_moment.view(count, rows)
        v.copy_(normuon_beta2 * v + (1 - normuon_beta2) * o.square().mean(dim=2))
        normalized = o / (v.sqrt() + normuon_eps).unsqueeze(2)
        norms = o.norm(dim=(1, 2), keepdim=True) / normalized.norm(dim=(1, 2), keepdim=True)
        ortho = (normalized * norms).to(ortho.dtype)
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


def _dion2_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    fraction: float,
    lr: float,
    ns_dtype: torch.dtype,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr: str | None,
    ns_steps: int,
    coefficients: str,
    ns_method: str,
    matrices: tuple[int, int, int] | None,
) -> None:
    momentum_buffer.add_(grad.float())
    update = torch.add(grad, momentum_buffer, alpha=beta) if nesterov else momentum_buffer
    count, rows, cols = matrices if matrices is not None else (1, *param.shape)
    stack = update.reshape(count, rows, cols)
    moms = momentum_buffer.view(count, rows, cols)
    ortho = torch.zeros(count, rows, cols, dtype=ns_dtype, device=param.device)
    by_rows = rows <= cols
    for i in range(count):
        x = stack[i] if by_rows else stack[i].T
        norms = [float(x[j].double().abs().sum()) for j in range(x.shape[0])]
        k = max(1, math.ceil(fraction * len(norms)))
        chosen = sorted(sorted(range(len(norms)), key=lambda j: (-norms[j], j))[:k])
        with ReorderedProducts():
            sub = newton_schulz(
                x[chosen].unsqueeze(0),
                steps=ns_steps,
                coefficients=coefficients,
                dtype=ns_dtype,
                backend="torch",
                method=ns_method,
            )[0]
        target = ortho[i] if by_rows else ortho[i].T
        mom = moms[i] if by_rows else moms[i].T
        for row, j in enumerate(chosen):
            target[j] = sub[row]
            mom[j] = mom[j] * beta
    param.copy_(param.float() * (1 - lr * weight_decay))
    param.add_(
        ortho.reshape(param.shape).to(param.dtype), alpha=-lr * lr_scale(rows, cols, adjust_lr)
    )
