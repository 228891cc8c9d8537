"""Muon (Jordan et al. 2024): momentum, orthogonalized by Newton–Schulz, scaled by the shape.

:func:`reference` is the rule for one matrix in plain torch, to be read against the
algorithm as torch's ``_single_tensor_muon`` is; the step computes it for many pieces at
once with :mod:`muon_dist.rules.ops`, and ``tests/unit/rules/test_rules.py`` holds the two together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from muon_dist.rules.base import MatrixStep, Rule
from muon_dist.rules.ops import MAGMA_EPS, MAGMA_MIN_SCALE


def reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    step: MatrixStep,
    *,
    cautious: bool = False,
    magma_score: torch.Tensor | None = None,
    magma_beta: float = 0.9,
) -> None:
    """One Muon step of one matrix ``param`` (``[out, in]``), in place.

    ``orthogonalize`` is Newton–Schulz. ``cautious`` decays only the weights whose sign the
    update shares; ``magma_score`` (one element) turns on Magma-lite's damping.
    """
    lr, beta = step.lr, step.beta
    momentum.mul_(beta).add_(grad)
    update = grad.add(momentum, alpha=beta) if step.nesterov else momentum
    ortho = orthogonalize(update)
    size = torch.tensor(lr * step.scale)
    if magma_score is not None:
        m, g = momentum.float(), grad.float()
        cosine = (m * g).sum() / (m.norm() * g.norm()).clamp_min(MAGMA_EPS)
        agreement = (1.0 + cosine.clamp(-1.0, 1.0)) / 2.0
        magma_score.mul_(magma_beta).add_(agreement * (1.0 - magma_beta))
        size = size * (MAGMA_MIN_SCALE + (1.0 - MAGMA_MIN_SCALE) * magma_score)
    if cautious:
        same_sign = torch.sign(ortho) == torch.sign(param)
        param.sub_(param * same_sign * (lr * step.weight_decay))
    else:
        param.mul_(1.0 - lr * step.weight_decay)
    param.sub_(ortho * size)


class MuonRule(Rule):
    """Muon's step, the base every other rule changes."""

    name = "muon"
