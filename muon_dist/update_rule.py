"""The Muon update rule: what a step computes, written once.

:func:`muon_update_` is the rule for one matrix, to be read against the algorithm
(see :class:`muon_dist.Muon`); every other function here computes a part of it for many
pieces at once, in torch (multi-tensor launches) or in a fused Triton pass, and the tests
(``tests/test_update_rule.py``) check each of them against it. The rest of the step only
decides how pieces are batched and moved, never what is computed.

Every scalar that follows the learning rate (decay factor, cautious rate, step size) and
the ``keep`` flag are tensors in device memory, so neither the rule nor a captured CUDA
graph of it reads them on the host. ``keep`` is how a step obeys its agreement without a
host branch: where it is 0 (no gradient on any rank, or a non-finite gradient somewhere)
the momentum, the Magma score and the weights stay bitwise as they were, and the
Newton–Schulz input is zero, which orthogonalizes to zero. :func:`fused_form` is the one
place that chooses between the torch and the fused form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from muon_dist.kernels.availability import triton_available

if TYPE_CHECKING:
    from muon_dist.flat import Span

# The update rules of Muon groups (a group's "rule"): the reference of each is below.
RULES = ("muon", "normuon", "dion2")

# Magma-lite: the update of a matrix is damped to MIN + (1 - MIN) * score, where the score is
# an EMA of (1 + cos(momentum, gradient)) / 2 over steps, started at 1 (no damping).
MAGMA_MIN_SCALE = 0.1
MAGMA_EPS = 1e-12

# Below this many elements the fused pass loses: a Triton launch costs about 20 us of CPU
# against 12-18 us for torch's two kernels, and a small piece moves few bytes either way. On
# an H200 (benchmarks/bench_elementwise.py, 2026-11-22) the two tie near 1M elements and the
# fused pass is 1.5x faster from 4M, up to 1.6x (momentum) and 2.3x (update) at 16M+.
FUSED_MIN_NUMEL = 1 << 21


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
    step holds them; ``scale`` is the lr scale of the full matrix shape (:func:`lr_scale`).
    ``carry`` is the factor on the stored momentum when the gradient is added (default
    ``beta``; see :func:`momentum_carry`).
    """
    advanced = advance_momentum(grad, momentum, beta if carry is None else carry)
    store_momentum_(momentum, advanced, keep)
    ortho = orthogonalize(momentum_input(grad, advanced, nesterov_mix(beta, nesterov)))
    kept = keep.float()
    rate = decay_rate(lr, weight_decay, kept)
    step = step_size(lr, kept, torch.tensor(-scale))
    if magma_score is not None:
        dot, mm, gg = magma_sums(advanced, grad).sum(1)
        magma_score_(magma_score, dot, mm, gg, beta=magma_beta, keep=keep)
        step = magma_damping(magma_score) * step
    ortho = torch.where(keep, ortho, 0.0)
    post_orthogonalize_(
        param,
        ortho,
        step=step,
        keep=keep,
        decay=None if cautious else decay_factor(rate),
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
    error_feedback_(momentum, update, beta, keep)


# -- scalars ----------------------------------------------------------------------------


def lr_scale(out_dim: int, in_dim: int, adjust_lr: str | None) -> float:
    """Learning-rate multiplier of a matrix, from its full shape (never a shard's)."""
    if adjust_lr == "spectral_norm":
        return math.sqrt(max(1.0, out_dim / in_dim))
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(out_dim, in_dim))
    return 1.0


def nesterov_mix(beta: float, nesterov: bool) -> float | None:
    """The weight of the momentum in Newton–Schulz's input ``g + mix·m``; None for ``m``."""
    return beta if nesterov else None


def decay_rate(lr: torch.Tensor, weight_decay: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``lr·wd`` where kept (1.0), 0 elsewhere: the cautious rate, or 1 − the decay factor."""
    return lr * weight_decay * kept


def decay_factor(rate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decoupled weight decay's factor ``1 − lr·wd``."""
    return torch.sub(1.0, rate, out=out)


def step_size(
    lr: torch.Tensor,
    kept: torch.Tensor,
    neg_scale: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``−lr·scale`` where kept, 0 elsewhere; ``index`` picks per piece from per tensor."""
    lr_kept = lr * kept
    if index is not None:
        lr_kept = lr_kept.index_select(0, index)
    return torch.mul(lr_kept, neg_scale, out=out)


# -- before Newton–Schulz ---------------------------------------------------------------


def advance_momentum(
    grad: torch.Tensor, momentum: torch.Tensor, beta: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``β·momentum + grad`` in one torch pass (into ``out`` when given)."""
    return torch.add(grad, momentum, alpha=beta, out=out)


def advance_momenta(
    grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor], beta: float
) -> Sequence[torch.Tensor]:
    """:func:`advance_momentum` of every pair, in one foreach launch."""
    return torch._foreach_add(list(grads), list(momenta), alpha=beta)


def momentum_input(grad: torch.Tensor, advanced: torch.Tensor, mix: float | None) -> torch.Tensor:
    """Newton–Schulz's input from an advanced momentum: ``g + mix·m``, or ``m``."""
    return advanced if mix is None else torch.add(grad, advanced, alpha=mix)


def ns_inputs_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    mix: float | None,
) -> None:
    """:func:`momentum_input` of every piece into ``outs``, computed in the momentum's dtype
    and cast on the copy; one foreach launch per step of the formula, however many pieces."""
    if mix is None:
        torch._foreach_copy_(list(outs), list(momenta))
    else:
        torch._foreach_copy_(list(outs), torch._foreach_add(list(grads), list(momenta), alpha=mix))


def store_momentum_(momentum: torch.Tensor, advanced: torch.Tensor, keep: torch.Tensor) -> None:
    """``momentum ← advanced`` where ``keep``; unchanged (bitwise) elsewhere."""
    torch.where(keep, advanced, momentum, out=momentum)


def store_momenta_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    beta: float,
    keep: torch.Tensor,
    span: Span | None = None,
) -> None:
    """Advance every momentum where ``keep`` (one flag for all of them).

    With ``span``, the momenta lie in order in one buffer (:func:`muon_dist.flat.spans`)
    and both lists hold one-dimensional views: the advanced values are written into one
    scratch buffer laid out like the span, and one ``where`` over the whole span stores
    them, instead of one per momentum. Both forms store what :func:`advance_momenta`
    computes.
    """
    if span is None or span.flat is None:
        for momentum, new in zip(momenta, advance_momenta(grads, momenta, beta), strict=True):
            store_momentum_(momentum, new, keep)
        return
    scratch = torch.empty_like(span.flat)
    advanced = span.split(scratch)
    torch._foreach_copy_(advanced, list(grads))
    torch._foreach_add_(advanced, list(momenta), alpha=beta)
    store_momentum_(span.flat, scratch, keep)


def pre_orthogonalize_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    beta: float,
    mix: float | None,
    keeps: Sequence[torch.Tensor],
    store: bool,
    fused: bool,
) -> None:
    """Advance the momenta and write Newton–Schulz's inputs into ``outs`` (cast to their
    dtype).

    A new momentum replaces the old one only when ``store`` and its ``keeps`` flag: a step
    that may still be skipped reads the next momentum without keeping it. The torch form
    leaves ``outs`` unmasked; the caller zeroes masked matrices in the stack
    (:func:`mask_stack_`). The fused form is one Triton pass over every tensor, in one
    launch per dtypes (:func:`fused_updates_` says why).
    """
    if fused:
        from muon_dist.kernels.triton_elementwise import momentum_inputs_triton

        momentum_inputs_triton(grads, momenta, outs, beta, mix, store, keeps)
        return
    advanced = advance_momenta(grads, momenta, beta)
    if store:
        for momentum, new, keep in zip(momenta, advanced, keeps, strict=True):
            store_momentum_(momentum, new, keep)
    ns_inputs_(grads, advanced, outs, mix)


def mask_stack_(stack: torch.Tensor, dropped: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Zero the matrices of a ``[k, m, n]`` stack that ``dropped`` (shape ``[k]``) marks.
    On CUDA (:func:`fused_form`) a Triton pass writes the dropped matrices only: a step
    rarely drops one, and a masked fill reads and writes the whole stack."""
    if fused_form(backend, stack):
        from muon_dist.kernels.triton_elementwise import zero_dropped_triton

        zero_dropped_triton(stack, dropped)
        return stack
    return stack.masked_fill_(dropped.view(-1, 1, 1), 0.0)


# -- Magma ------------------------------------------------------------------------------


def magma_sums(momentum: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Per dim-0 row, ``[m·g, m·m, g·g]`` in fp32 (shape ``[3, rows]``); summed over a
    matrix's rows (on every rank that holds some) they give its cosine."""
    m, g = momentum.float(), grad.float()
    dims = tuple(range(1, m.ndim))
    return torch.stack([(m * g).sum(dims), m.square().sum(dims), g.square().sum(dims)])


def magma_score_(
    score: torch.Tensor,
    dot: torch.Tensor,
    mm: torch.Tensor,
    gg: torch.Tensor,
    *,
    beta: float,
    keep: torch.Tensor,
) -> None:
    """Advance each matrix's score, an EMA of ``(1 + cos(m, g)) / 2``, where ``keep``."""
    cosine = (dot / (mm.sqrt() * gg.sqrt()).clamp_min(MAGMA_EPS)).clamp(-1.0, 1.0)
    new = score * beta + (1.0 + cosine) / 2.0 * (1.0 - beta)
    torch.where(keep, new, score, out=score)


def magma_damping(score: torch.Tensor) -> torch.Tensor:
    """Each matrix's factor on its step: ``MIN + (1 − MIN)·score``."""
    return MAGMA_MIN_SCALE + (1.0 - MAGMA_MIN_SCALE) * score


# -- Dion2's selection -------------------------------------------------------------------


def momentum_carry(group: dict[str, Any]) -> float:
    """The factor on a group's stored momentum when a gradient is added: ``momentum`` (β),
    but 1 under Dion2, whose decay hits only the slices it orthogonalized."""
    return 1.0 if group.get("rule", "muon") == "dion2" else float(group["momentum"])


def selected_count(length: int, fraction: float) -> int:
    """How many of ``length`` slices Dion2 orthogonalizes: ``⌈fraction·length⌉``, at least 1."""
    return min(length, max(1, math.ceil(fraction * length)))


def slice_norms(x: torch.Tensor, axis: int, backend: str = "torch") -> torch.Tensor:
    """The L1 norm of each slice of each matrix of ``x`` (``[..., m, n]``) along ``axis``
    (-2: rows, -1: columns), summed in float64: exact for bf16 entries within 2^45 of each
    other and, for fp32 ones, rounded far below their own precision, so the same for any
    batching or summation order. On CUDA a
    fused Triton pass reads ``x`` in place (torch would first copy it to float64)."""
    if x.ndim == 3 and fused_form(backend, x):
        from muon_dist.kernels.triton_elementwise import slice_l1_triton

        return slice_l1_triton(x, axis)
    return x.abs().sum(-1 if axis == -2 else -2, dtype=torch.float64)


def add_slice_norms_(
    norms: torch.Tensor,
    xs: Sequence[torch.Tensor],
    axes: Sequence[int],
    slots: Sequence[torch.Tensor],
    backend: str = "torch",
) -> None:
    """Add :func:`slice_norms` of each ``[k, m, n]`` tensor of ``xs`` (along its axis) into
    the float64 vector ``norms`` at its ``slots`` (``[k, slices]``): the pieces' partial
    norms of the slices they hold. On CUDA one Triton launch for all
    (:func:`fused_launches`: it saves a launch per piece), outside graph capture."""
    if xs and fused_launches(backend, xs[0]) and not torch.cuda.is_current_stream_capturing():
        from muon_dist.kernels.triton_elementwise import add_slice_l1_triton

        add_slice_l1_triton(norms, xs, axes, slots)
        return
    for x, axis, where in zip(xs, axes, slots, strict=True):
        norms.index_add_(0, where.reshape(-1), slice_norms(x, axis).reshape(-1))


def select_slices(x: torch.Tensor, axis: int, count: int, backend: str = "torch") -> torch.Tensor:
    """The ``count`` slices of each matrix of ``x`` (``[..., m, n]``) along ``axis`` (-2:
    rows, -1: columns) with the largest L1 norms (:func:`slice_norms`), ascending (shape
    ``[..., count]``); ties go to the lower index (a stable sort), so the choice depends on
    the values only, never on how they were batched or laid out."""
    return top_slices(slice_norms(x, axis, backend), count)


def top_slices(norms: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the ``count`` largest of each row of ``norms`` (``[..., L]``),
    ascending; ties go to the lower position (a stable sort)."""
    order = torch.sort(norms, dim=-1, descending=True, stable=True).indices
    return order[..., :count].sort(dim=-1).values


def selected_orthogonalize(
    x: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    fraction: float,
    transposed: bool,
    backend: str = "torch",
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dion2's Newton–Schulz: ``orthogonalize`` on the selected slices of each matrix of
    ``x`` (``[..., m, n]``, stored ``[in, out]`` when ``transposed``), zero elsewhere.

    The slices are output rows when a matrix has no more outputs than inputs, else input
    columns; ``index`` (``[..., count]``, ascending) names them where they were chosen
    before (from norms summed across ranks), else :func:`select_slices` chooses. Every
    entry of a selected slice that comes out zero is stored as ``-0.0``, so the result
    alone marks the selection (:func:`selected_mask`) wherever it travels.
    """
    rows, cols = x.shape[-2], x.shape[-1]
    out_dim, in_dim = (cols, rows) if transposed else (rows, cols)
    outputs = -1 if transposed else -2
    axis = outputs if out_dim <= in_dim else (-1 if outputs == -2 else -2)
    count = selected_count(x.shape[axis], fraction)
    if index is None:
        index = select_slices(x, axis, count, backend)
    if axis == -2:
        spread = index.unsqueeze(-1).expand(*index.shape, cols)
    else:
        spread = index.unsqueeze(-2).expand(*index.shape[:-1], rows, count)
    result = orthogonalize(torch.gather(x, axis, spread))
    result = torch.where(result == 0, -0.0, result)
    return result.new_zeros(x.shape).scatter_(axis, spread, result)


def selected_mask(update: torch.Tensor) -> torch.Tensor:
    """Where an update of :func:`selected_orthogonalize` lies in a selected slice: nonzero
    or a negative zero (the slices left out are positive zeros)."""
    return (update != 0).logical_or_(torch.signbit(update))


def error_feedback_(
    momentum: torch.Tensor,
    update: torch.Tensor,
    beta: float,
    keep: torch.Tensor,
    backend: str = "torch",
) -> None:
    """Dion2's error feedback: ``momentum ← β·momentum`` on the selected slices, where
    ``keep``; elsewhere unchanged (bitwise). One fused pass on CUDA (:func:`fused_form`)."""
    if fused_form(backend, momentum, update):
        from muon_dist.kernels.triton_elementwise import error_feedback_triton

        error_feedback_triton(momentum, update, beta, keep)
        return
    decay = selected_mask(update).logical_and_(keep)
    torch.where(decay, momentum * beta, momentum, out=momentum)


# -- NorMuon's row normalization --------------------------------------------------------
# Written for one matrix ``[m, n]`` or a stack ``[k, m, n]`` alike (rows on the last but
# one dimension): the reference and the owner's batched form run the same functions.


def row_squares(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares in fp32, shape ``[..., m]``, read straight from ``rows``
    (any dtype, any strides: a transposed view costs no copy); summed over a matrix's
    holders (each row counted once) they are the whole matrix's."""
    norms: torch.Tensor = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32)
    return norms.square()


def second_moment_next(
    second_moment: torch.Tensor,
    squares: torch.Tensor,
    beta2: float | torch.Tensor,
    weight: float | torch.Tensor,
) -> torch.Tensor:
    """``β₂·v + (1 − β₂)·squares / n``, with ``weight = (1 − β₂) / n``. Two products and a
    sum, each rounded once, so every rank that computes it from the same values agrees
    bitwise, whatever the layout of the vectors."""
    return second_moment * beta2 + squares * weight


def row_factors(
    squares: torch.Tensor, second_moment: torch.Tensor, eps: float | torch.Tensor
) -> torch.Tensor:
    """Each row's factor in ``Ô = O / (√v + ε)`` rescaled to ``O``'s Frobenius norm, per
    matrix (fp32, shape of ``squares``).

    Both norms come from the row sums of squares: ``‖Ô‖² = Σᵢ squaresᵢ / (√vᵢ + ε)²``.
    A zero matrix (dropped by the step) gets zero factors and stays zero.
    """
    denom = second_moment.sqrt() + eps
    before = squares.sum(-1, keepdim=True)
    after = (squares / denom.square()).sum(-1, keepdim=True)
    ratio = (before / after.clamp_min(torch.finfo(torch.float32).tiny)).sqrt()
    return ratio / denom


def owner_row_factors(
    squares: torch.Tensor,
    index: torch.Tensor,
    coefficients: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    primary: torch.Tensor | None,
    sums: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """An owner's NorMuon factors for ``[k, m]`` row ``squares`` whose rows lie at
    ``index`` in the per-row vectors ``coefficients`` (current moment, β₂, weight, ε):
    :func:`second_moment_next` then :func:`row_factors`; the squares are also written to
    ``sums`` at ``index`` (zero for the matrices not ``primary``, ``[k, 1]``). On CUDA one
    Triton launch replaces about twenty small ones (:func:`fused_launches`)."""
    current, beta2, weight, eps = coefficients
    if fused_launches(backend, squares):
        from muon_dist.kernels.triton_elementwise import row_factors_triton

        return row_factors_triton(squares, index, current, beta2, weight, eps, primary, sums)
    moment = second_moment_next(current[index], squares, beta2[index], weight[index])
    reported = squares if primary is None else torch.where(primary, squares, 0.0)
    sums.index_copy_(0, index.reshape(-1), reported.reshape(-1))
    return row_factors(squares, moment, eps[index])


def scale_rows_(
    x: torch.Tensor, factors: torch.Tensor, *, columns: bool = False, backend: str = "torch"
) -> None:
    """``x``'s rows (columns with ``columns``: a matrix stored ``[in, out]``) times their
    fp32 ``factors``, in place, the product rounded once to ``x``'s dtype.

    One pass over ``x``; torch's broadcast multiply is not vectorised, so on CUDA the fused
    Triton pass runs where :func:`fused_form` chooses it (a contiguous ``x``).
    """
    if not x.is_contiguous() and x.mT.is_contiguous():
        x, columns = x.mT, not columns  # Newton–Schulz hands tall matrices back transposed
    if fused_form(backend, x):
        from muon_dist.kernels.triton_elementwise import scale_rows_triton

        scale_rows_triton(x, factors, columns)
        return
    x.mul_(factors.unsqueeze(-2) if columns else factors.unsqueeze(-1))


# -- after Newton–Schulz ----------------------------------------------------------------


def decay_(params: Sequence[torch.Tensor], factors: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Decoupled weight decay of whole tensors before their writes, one launch for all."""
    torch._foreach_mul_(list(params), factors)  # type: ignore[arg-type]


def post_orthogonalize_(
    param: torch.Tensor,
    update: torch.Tensor,
    *,
    step: torch.Tensor,
    keep: torch.Tensor,
    decay: torch.Tensor | None = None,
    cautious: torch.Tensor | None = None,
    fused: bool = False,
    feedback: tuple[torch.Tensor, float] | None = None,
) -> None:
    """``param ← d·param + step·update``; with a Dion2 ``feedback`` (momentum, β), also its
    :func:`error_feedback_`, in the same pass where the write is fused.

    ``decay`` is given where this write also applies the decoupled decay (otherwise it ran
    over the whole tensor before, :func:`decay_`); ``cautious`` is the rate of cautious
    decay, applied only where the update and the weight share a sign. ``step`` is one
    element, or one per row of ``param`` (Magma). Where ``keep`` is false the caller passes
    scalars with no effect (decay 1, step and cautious rate 0) and a finite update
    (:func:`mask_stack_` makes it zero), so the torch form needs no mask; the fused form
    also skips the write there.
    """
    if fused and decay is not None and cautious is None and step.numel() == 1:
        from muon_dist.kernels.triton_elementwise import decay_and_update_triton

        decay_and_update_triton(param, update, decay, step, keep, feedback)
        return
    if feedback is not None:
        error_feedback_(feedback[0], update, feedback[1], keep)
    if cautious is not None:
        same_sign = torch.sign(update) == torch.sign(param)
        param.sub_(param * same_sign * cautious)
    if decay is not None:
        param.mul_(decay)
    param.addcmul_(update, step)


def fused_updates_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    decays: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    keeps: Sequence[torch.Tensor],
    feedbacks: Sequence[tuple[torch.Tensor, float] | None],
) -> None:
    """The fused form of :func:`post_orthogonalize_` (with the decay, one-element steps,
    no cautious decay) on many pieces in one launch: a launch per piece costs the host more
    than the pass costs the GPU."""
    from muon_dist.kernels.triton_elementwise import decay_and_updates_triton

    decay_and_updates_triton(params, updates, decays, steps, keeps, feedbacks)


def drop_unkept(update: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The update where ``keep``, zero elsewhere: an update computed before the step was
    agreed may be non-finite there, and a zero step would not cancel it."""
    return torch.where(keep, update, 0.0)


def updates_(
    params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], steps: Sequence[torch.Tensor]
) -> None:
    """:func:`post_orthogonalize_` without decay for many pieces, one foreach launch."""
    torch._foreach_addcmul_(list(params), list(updates), list(steps))


def shared_step_updates_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    step: torch.Tensor,
    scratch: torch.Tensor,
    scaled: Sequence[torch.Tensor],
    ok: torch.Tensor | None = None,
) -> None:
    """``param += step·update`` for pieces that share one step: cast the updates into
    ``scaled`` (views of ``scratch``, shaped like the params), scale, add; three launches
    for all. With ``ok`` (the step's flag) the scaled updates are zeroed where it is false,
    in one pass over ``scratch`` (see :func:`drop_unkept`)."""
    torch._foreach_copy_(list(scaled), list(updates))
    torch._foreach_mul_(list(scaled), step)
    if ok is not None:
        scratch.masked_fill_(ok.logical_not(), 0.0)
    torch._foreach_add_(list(params), list(scaled))


def fused_launches(backend: str, tensor: torch.Tensor) -> bool:
    """Whether a pass whose torch form is many small launches on small tensors takes its
    one-launch Triton form: wherever the backend allows Triton on CUDA, whatever the size,
    since what it saves is the host's time per launch."""
    return backend != "torch" and tensor.is_cuda and triton_available()


def fused_form(backend: str, *tensors: torch.Tensor) -> bool:
    """Whether the fused Triton form runs on these tensors, under the optimizer's backend.

    "torch" never fuses; "triton" fuses every contiguous CUDA tensor; "auto" only those of
    at least :data:`FUSED_MIN_NUMEL` elements, where the fused pass measured faster.
    """
    first = tensors[0]
    if backend == "torch" or not first.is_cuda:
        return False
    if backend == "auto" and first.numel() < FUSED_MIN_NUMEL:
        return False
    return all(t.shape == first.shape and t.is_contiguous() for t in tensors) and triton_available()
