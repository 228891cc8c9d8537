"""Each rule's single-matrix step composed of the step's own batched ops
(:mod:`muon_dist.rules.ops`, :mod:`~muon_dist.rules.rows`, :mod:`~muon_dist.rules.slices`),
with device scalars and the ``keep`` flag as the step holds them.

The tests hold every batched and fused form bitwise to these, and these to each rule's
plain-torch ``reference`` (:mod:`muon_dist.rules.muon` and its siblings) within rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from muon_dist.rules import ops
from muon_dist.rules.rows import row_factors, row_squares, scale_rows_, second_moment_next
from muon_dist.rules.slices import selected_orthogonalize


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
    """One Muon step of one matrix, in place: the reference for every form below. Returns
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
    """One NorMuon step of one matrix, in place: Muon's step (:func:`muon_update_`) on
    row-normalized orthogonalized updates; the reference for its distributed form.

    NorMuon (Li et al. 2025, arXiv 2510.05491, Algorithm 1) keeps Muon's momentum and
    orthogonalization, then normalizes each output row (neuron) of ``O = NS(·)``, an
    ``m x n`` matrix (``transposed``: stored ``[in, out]``, so its columns are the rows)::

        v ← β₂·v + (1 − β₂)·mean_cols(O ⊙ O)            (v: one entry per row, fp32)
        Ô = O / (√v + ε)                                  (row i divided by √v_i + ε)
        W ← W·(1 − η·λ) − η·scale·(‖O‖_F / ‖Ô‖_F)·Ô

    The paper's step ``η̂ = 0.2·η·√(mn) / ‖Ô‖_F`` sets the update's RMS; here ``Ô`` is
    rescaled to ``‖O‖_F`` and the group's ``adjust_lr`` applies as for Muon, so lr and
    ``adjust_lr`` keep their meaning across the two rules; with ``adjust_lr="rms_norm"``
    and an orthogonal ``O`` (``‖O‖_F = √min(m, n)``) the two steps are the same.
    ``second_moment`` (shape ``[m]``) advances only where ``keep``.
    """

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
    """One Dion2 step of one matrix, in place: Muon's step (:func:`muon_update_`) on a
    fraction of the matrix's slices; the reference for its distributed form.

    Dion2 (Ahn et al., microsoft/dion ``dion2.py``) orthogonalizes only the ``k`` slices
    (output rows when the matrix has no more outputs than inputs, else input columns: the
    shorter side) whose Newton–Schulz input has the largest L1 norms, and decays only
    those::

        A = M + G                                     (no decay here)
        X = A  (Nesterov: X = G + β·A)                (Newton–Schulz's input, as Muon's)
        S = top_k(X)                                  (:func:`select_slices`)
        O = NS(X[S])                                  (k slices; zero elsewhere)
        M = A, then M[S] ← β·A[S]                     (error feedback, :func:`error_feedback_`)
        W ← W·(1 − η·λ) − η·scale·O

    ``β`` is the group's ``momentum`` (the paper's error-feedback decay; its Dion2 is
    ``nesterov=False``), ``scale`` the lr scale of the full matrix, ``k = ⌈fraction·L⌉``
    for ``L`` slices. With ``fraction=1`` every slice is selected every step, so the stored
    momentum is ``β·(M + G)`` and the step is Muon's. ``transposed``: stored ``[in, out]``.
    """
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
