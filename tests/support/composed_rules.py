"""Each rule's single-matrix step composed of the step's own batched ops
(:mod:`muon_dist.rules.ops`, :mod:`~muon_dist.rules.normuon_rows`,
:mod:`~muon_dist.rules.dion2_slices`),
with device scalars and the ``keep`` flag as the step holds them.

The tests hold every batched and fused form bitwise to these, and these to each rule's
plain-torch ``reference`` (:mod:`muon_dist.rules.muon` and its siblings) within rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from muon_dist.rules import ops
from muon_dist.rules.dion2_slices import selected_orthogonalize
from muon_dist.rules.normuon_rows import row_factors, row_squares, scale_rows_, second_moment_next


def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    *,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    beta: float,
    nesterov: bool,
    scale: float,
    keep: torch.Tensor,
    cautious: bool = False,
    magma_score: torch.Tensor | None = None,
    magma_beta: float = 0.9,
    carry: float | None = None,
) -> torch.Tensor:
    """One Muon step of one matrix from the step's ops, held bitwise to every batched and
    fused form and to :func:`muon_dist.rules.muon.reference` within rounding. Returns
    the orthogonalized update as applied (zero where not kept), for a rule's state.

    ``lr`` and ``weight_decay`` are fp32 device scalars and ``keep`` a bool one, as the
    step holds them; ``scale`` is the lr scale of the full matrix shape
    (:func:`muon_dist.rules.scale.lr_scale`). ``carry`` is the factor on the stored momentum
    when the gradient is added (default ``beta``; see
    :meth:`muon_dist.rules.base.Rule.momentum_carry`).
    """
    advanced = ops.advance_momentum(grad, momentum, beta if carry is None else carry)
    ops.store_momentum_(momentum, advanced, keep)
    ortho = orthogonalize(ops.momentum_input(grad, advanced, ops.nesterov_mix(beta, nesterov)))
    kept = keep.float()
    rate = ops.decay_rate(lr, weight_decay, kept)
    step = ops.step_size(lr, kept, torch.tensor(-scale))
    if magma_score is not None:
        dot, mm, gg = ops.magma_sums(advanced, grad).sum(1)
        ops.magma_score_(magma_score, dot, mm, gg, beta=magma_beta, keep=keep)
        step = ops.magma_damping(magma_score) * step
    ortho = torch.where(keep, ortho, 0.0)
    ops.post_orthogonalize_(
        param,
        ortho,
        step=step,
        keep=keep,
        decay=None if cautious else ops.decay_factor(rate),
        cautious=rate if cautious else None,
    )
    return ortho


def normuon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    second_moment: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    *,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    beta: float,
    nesterov: bool,
    scale: float,
    keep: torch.Tensor,
    beta2: float,
    eps: float,
    transposed: bool = False,
) -> None:
    """One NorMuon step of one matrix from the step's ops: :func:`muon_update_` on
    row-normalized orthogonalized updates (the rule: :func:`muon_dist.rules.normuon.reference`).
    ``second_moment`` (shape ``[m]``) advances only where ``keep``."""

    def normalized(update: torch.Tensor) -> torch.Tensor:
        ortho = torch.where(keep, orthogonalize(update), 0.0)
        rows = ortho.mT if transposed else ortho
        squares = row_squares(rows)
        advanced = second_moment_next(second_moment, squares, beta2, (1.0 - beta2) / rows.shape[-1])
        # The normalized update stays in Newton–Schulz's dtype, as Muon's does.
        scale_rows_(ortho, row_factors(squares, advanced, eps), columns=transposed)
        torch.where(keep, advanced, second_moment, out=second_moment)
        return ortho

    muon_update_(
        param,
        grad,
        momentum,
        normalized,
        lr=lr,
        weight_decay=weight_decay,
        beta=beta,
        nesterov=nesterov,
        scale=scale,
        keep=keep,
    )


def dion2_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    *,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    beta: float,
    nesterov: bool,
    scale: float,
    keep: torch.Tensor,
    fraction: float,
    transposed: bool = False,
) -> None:
    """One Dion2 step of one matrix from the step's ops: :func:`muon_update_` on the
    selected slices, then the error feedback (the rule: :func:`muon_dist.rules.dion2.reference`)."""
    update = muon_update_(
        param,
        grad,
        momentum,
        lambda x: selected_orthogonalize(x, orthogonalize, fraction, transposed),
        lr=lr,
        weight_decay=weight_decay,
        beta=beta,
        nesterov=nesterov,
        scale=scale,
        keep=keep,
        carry=1.0,
    )
    ops.error_feedback_(momentum, update, beta, keep)
