"""NorMuon (Li et al. 2025, arXiv 2510.05491): Muon with each output row of the orthogonalized
update normalized by a running second moment.

:func:`reference` is the rule for one matrix in plain torch; the owner's batched form is
:mod:`muon_dist.rules.normuon_rows` with :mod:`muon_dist.state.normuon_moments`, bound to a
step by its wing (:mod:`muon_dist.step.wings.normuon`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from muon_dist.rules import muon
from muon_dist.rules.base import MatrixStep, Rule, RulePart, ViewShape

# The per-row second moments of a parameter, one fp32 entry per output row of each matrix.
ROW_MOMENT = "row_second_moment"


def reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    second_moment: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    step: MatrixStep,
    *,
    beta2: float,
    eps: float,
    transposed: bool = False,
) -> None:
    """One NorMuon step of one matrix, in place (``transposed``: stored ``[in, out]``)::

        v ← β₂·v + (1 − β₂)·mean_cols(O ⊙ O)            (v: one fp32 entry per row)
        Ô = O / (√v + ε)
        W ← W·(1 − η·λ) − η·scale·(‖O‖_F / ‖Ô‖_F)·Ô

    The paper's step ``0.2·η·√(mn) / ‖Ô‖_F`` sets the update's RMS; here ``Ô`` is rescaled
    to ``‖O‖_F`` and ``adjust_lr`` applies as for Muon, so lr and ``adjust_lr`` keep their
    meaning across the rules (with ``rms_norm`` and an orthogonal ``O`` the steps agree).
    """

    def normalized(update: torch.Tensor) -> torch.Tensor:
        ortho = orthogonalize(update)
        rows = (ortho.mT if transposed else ortho).float()
        second_moment.mul_(beta2).add_(rows.square().mean(-1), alpha=1.0 - beta2)
        scaled = rows / (second_moment.sqrt() + eps).unsqueeze(-1)
        scaled = scaled * (rows.norm() / scaled.norm().clamp_min(torch.finfo(torch.float32).tiny))
        result: torch.Tensor = (scaled.mT if transposed else scaled).to(ortho.dtype)
        return result

    muon.reference(param, grad, momentum, normalized, step)


def row_count(views: Sequence[ViewShape]) -> int:
    """Output rows over every matrix of a parameter's views: its second moment's length."""
    return sum(view.count * view.out_in[0] for view in views)


class NorMuon(Rule):
    """Muon's step on row-normalized orthogonalized updates."""

    name = "normuon"
    wing = "muon_dist.step.wings.normuon:NorMuonWing"
    fp32_state = (ROW_MOMENT,)

    def state_shapes(self, views: Sequence[ViewShape]) -> dict[str, tuple[int, ...]]:
        return {ROW_MOMENT: (row_count(views),)}

    def stack_part(self, group: dict[str, Any], transposed: bool) -> RulePart:
        return RulePart(self.name, transposed)
