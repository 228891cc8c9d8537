"""Dion2 (Ahn et al., microsoft/dion): Muon's step on a fraction of each matrix's slices, with
error feedback on the momentum of the slices it orthogonalized.

:func:`reference` is the rule for one matrix in plain torch; the batched form is
:mod:`muon_dist.rules.dion2_slices`, the distributed selection
:mod:`muon_dist.plan.dion2_selection`, the step's part its wing (:mod:`muon_dist.step.wings.dion2`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from muon_dist.rules.base import MatrixStep, Rule, RulePart
from muon_dist.rules.dion2_slices import slice_axis


def reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    step: MatrixStep,
    *,
    fraction: float,
    transposed: bool = False,
) -> None:
    """One Dion2 step of one matrix, in place (``transposed``: stored ``[in, out]``)::

        A = M + G                                     (no decay here)
        X = A  (Nesterov: X = G + β·A)
        S = the ⌈fraction·L⌉ slices of X with the largest L1 norms (ties: lower index)
        O = NS(X[S]) on S, zero elsewhere
        M = A, then M[S] ← β·A[S]                     (error feedback)
        W ← W·(1 − η·λ) − η·scale·O

    With ``fraction=1`` every slice is selected, the stored momentum is ``β·(M + G)`` and
    the step is Muon's.
    """
    momentum.add_(grad)
    x = grad.add(momentum, alpha=step.beta) if step.nesterov else momentum
    rows, cols = x.shape
    out_dim, in_dim = (cols, rows) if transposed else (rows, cols)
    axis = slice_axis(out_dim, in_dim, transposed)
    norms = x.double().abs().sum(-1 if axis == -2 else -2)
    count = max(1, math.ceil(fraction * norms.numel()))
    chosen = torch.sort(norms, descending=True, stable=True).indices[:count].sort().values
    ortho = torch.zeros_like(x)
    ortho.index_copy_(axis, chosen, orthogonalize(x.index_select(axis, chosen)).to(x.dtype))
    momentum.index_copy_(axis, chosen, momentum.index_select(axis, chosen) * step.beta)
    param.mul_(1.0 - step.lr * step.weight_decay)
    param.sub_(ortho, alpha=step.lr * step.scale)


class Dion2(Rule):
    """Muon's step on the top slices of each matrix, with error feedback."""

    name = "dion2"
    wing = "muon_dist.step.wings.dion2:Dion2Wing"

    def momentum_carry(self, group: dict[str, Any]) -> float:
        # The decay hits only the slices it orthogonalized, after the step (error feedback).
        return 1.0

    def stack_part(self, group: dict[str, Any], transposed: bool) -> RulePart:
        return RulePart(self.name, transposed, float(group["dion2_fraction"]))

    def travelling_share(self, group: dict[str, Any]) -> float:
        return float(group["dion2_fraction"])

    def check_group(self, group: dict[str, Any], where: str) -> None:
        for key in ("magma", "cautious_wd"):
            if group[key]:
                raise ValueError(
                    f"{where}: {key}=True with rule='dion2'; Dion2 updates only its selected "
                    f"slices, which {key} does not account for: set {key}=False in this "
                    "group or use rule='muon'"
                )
