"""Single-device Muon, NorMuon and Dion2 whose momentum is stored in bf16, written from the
algorithms' definitions (DESIGN.md, the papers), not from muon_dist's code.

``momentum_dtype="bf16"`` promises fp32 arithmetic on a bf16 store: each step reads the
stored momentum, widens it, advances it in fp32 and rounds the result once to bf16; the
Nesterov mix and Dion2's slice choice read that rounded momentum, and Dion2's error feedback
rounds ``β·M`` once more where it decays. Newton–Schulz here runs in float64, so a
comparison with the optimizer's fp32 Newton–Schulz sees only fp32 rounding from it (the
parity tests' exact bound). The tests take ``store`` as the dtype the momentum is rounded
to: bf16, or fp32 to show that the bf16 rounding is what they detect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The default "quintic" schedule: one (a, b, c) per iteration (DESIGN.md).
QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NS_EPS = 1e-7


@dataclass(frozen=True)
class Hyper:
    """One group's hyper-parameters, as the tests pass them to ``muon_dist.Muon``."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    normuon_beta2: float = 0.95
    normuon_eps: float = 1e-8
    dion2_fraction: float = 0.25


def orthogonalize(u: torch.Tensor) -> torch.Tensor:
    """Newton–Schulz in float64: ``X = U/(‖U‖_F + ε)`` on the wide orientation, then per
    iteration ``A = X·Xᵀ, B = b·A + c·A·A, X = a·X + B·X``."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for a, b, c in QUINTIC:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def advance(momentum: torch.Tensor, grad: torch.Tensor, beta: float, store: torch.dtype) -> None:
    """``M ← round(β·M + G)``: read widened, advanced in fp32, rounded once to ``store``."""
    momentum.copy_(torch.add(grad.float(), momentum.float(), alpha=beta).to(store))


def step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    hyper: Hyper,
    *,
    rule: str = "muon",
    store: torch.dtype = torch.bfloat16,
    row_moment: torch.Tensor | None = None,
) -> None:
    """One step of one ``[out, in]`` fp32 matrix in place under ``rule``; ``momentum`` (kept
    in ``store``) and NorMuon's ``row_moment`` (fp32, one per row) advance too."""
    rows, cols = param.shape
    beta = hyper.momentum
    advance(momentum, grad, 1.0 if rule == "dion2" else beta, store)
    stored = momentum.float()
    update = grad.float() + beta * stored if hyper.nesterov else stored
    if rule == "dion2":
        ortho = _dion2_ortho(update, momentum, hyper, store)
    else:
        ortho = orthogonalize(update)
    if rule == "normuon":
        assert row_moment is not None
        row_moment.mul_(hyper.normuon_beta2).add_(
            ortho.square().mean(1), alpha=1 - hyper.normuon_beta2
        )
        scaled = ortho / (row_moment.sqrt() + hyper.normuon_eps).unsqueeze(1)
        ortho = scaled * (ortho.norm() / scaled.norm())
    scale = math.sqrt(max(1.0, rows / cols))
    param.mul_(1 - hyper.lr * hyper.weight_decay).sub_(ortho, alpha=hyper.lr * scale)


def _dion2_ortho(
    update: torch.Tensor, momentum: torch.Tensor, hyper: Hyper, store: torch.dtype
) -> torch.Tensor:
    """Dion2 (Ahn et al.): of the slices along the shorter side (rows on a tie), the
    ``⌈fraction·L⌉`` with the largest L1 norms (ties: lower index) are orthogonalized as one
    matrix, the rest of the update is zero, and only their momentum decays by β (error
    feedback, rounded once to ``store``)."""
    by_rows = update.shape[0] <= update.shape[1]
    x = update if by_rows else update.T
    norms = x.double().abs().sum(1)
    count = max(1, math.ceil(hyper.dion2_fraction * norms.numel()))
    chosen = torch.sort(norms, descending=True, stable=True).indices[:count].sort().values
    ortho = torch.zeros_like(x)
    ortho[chosen] = orthogonalize(x[chosen])
    slices = momentum if by_rows else momentum.T
    slices[chosen] = (slices[chosen].float() * hyper.momentum).to(store)
    return ortho if by_rows else ortho.T


def relative(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """How far ``got`` is from ``want``, relative to the update ``want - start`` (norm-wise):
    lr and the lr scale multiply an update and its error alike, so this is the bound the
    parity tests state."""
    delta = (want.double() - start.double()).norm()
    return float((got.double() - want.double()).norm() / delta)
