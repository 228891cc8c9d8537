"""The batched device ops every rule's step is made of: momentum, Newton–Schulz's inputs,
Magma, decay and the writes, for many pieces at once.

Each op computes a part of a rule's single-matrix reference (:mod:`muon_dist.rules.muon`)
for many pieces, in torch (multi-tensor launches) or in a fused Triton pass
(:mod:`muon_dist.rules.forms` chooses); ``tests/unit/state/test_update_rule.py`` checks each against
the reference. The rest of the step only decides how pieces are batched and moved, never
what is computed.

Every scalar that follows the learning rate (decay factor, cautious rate, step size) and
the ``keep`` flag are tensors in device memory, so neither an op nor a captured CUDA graph
of it reads them on the host. ``keep`` is how a step obeys its agreement without a host
branch: where it is 0 (no gradient on any rank, or a non-finite gradient somewhere) the
momentum, the Magma score and the weights stay bitwise as they were, and the Newton–Schulz
input is zero, which orthogonalizes to zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muon_dist.kernels.triton_ns import TRITON_DTYPES
from muon_dist.rules.forms import fused_form

# Magma-lite: the update of a matrix is damped to MIN + (1 - MIN) * score, where the score is
# an EMA of (1 + cos(momentum, gradient)) / 2 over steps, started at 1 (no damping).
MAGMA_MIN_SCALE = 0.1
MAGMA_EPS = 1e-12


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


@dataclass(frozen=True)
class ScalarLayout:
    """Where a step's scalars take their values from, fixed per plan: per Muon tensor its
    group (``group_of``) and whether its decay is cautious (``cautious_mask``, 1.0 or 0.0;
    ``plain_mask`` its complement); per piece its tensor and ``−lr_scale``; per step class
    (pieces of one group and lr scale) its group and ``−lr_scale``; per stacked matrix its
    tensor."""

    group_of: torch.Tensor  # long, per tensor
    plain_mask: torch.Tensor  # fp32, per tensor
    cautious_mask: torch.Tensor  # fp32, per tensor
    piece_tensor: torch.Tensor  # long, per piece
    neg_scale: torch.Tensor  # fp32, per piece
    class_group: torch.Tensor  # long, per step class
    class_neg_scale: torch.Tensor  # fp32, per step class
    stack_tensor: torch.Tensor  # long, per stacked matrix


@dataclass(frozen=True)
class StepScalars:
    """What the update rule reads of one step, in device memory: per Muon tensor the agreed
    ``keep``, the decay factor (1 where cautious) and the cautious rate; per piece its step;
    ``ok`` (nothing found non-finite); per group the decay factor and per step class the
    step of tensors with a local gradient (kept exactly when the step is); per stacked
    matrix whether the step drops it."""

    keep: torch.Tensor  # bool, per tensor
    decay: torch.Tensor
    cautious: torch.Tensor
    step: torch.Tensor  # per piece
    ok: torch.Tensor  # bool, one element
    group_decay: torch.Tensor
    class_step: torch.Tensor
    dropped: torch.Tensor  # bool, per stacked matrix


def stage_scalars_(
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    keep: torch.Tensor,
    found_inf: torch.Tensor,
    layout: ScalarLayout,
    out: StepScalars,
    *,
    drop: bool,
    fused: bool,
) -> None:
    """Fill ``out`` from the groups' ``lr`` and ``weight_decay`` and the agreed ``keep``
    (per tensor) and ``found_inf`` by ``layout`` (:func:`decay_rate`, :func:`decay_factor`,
    :func:`step_size`); ``drop``: mark the stacked matrices of unkept tensors in
    ``out.dropped`` too. The torch form is about twenty launches of a few elements each;
    the fused form (bitwise equal: each product rounded where torch rounds it) is one."""
    if fused:
        from muon_dist.kernels.triton_elementwise import step_scalars_triton

        sources = {"lr": lr, "weight_decay": weight_decay, "keep": keep, "found_inf": found_inf}
        step_scalars_triton(sources, vars(layout), vars(out), drop)
        return
    out.keep.copy_(keep)
    kept = out.keep.float()
    tensor_lr = lr.index_select(0, layout.group_of)
    rate = decay_rate(tensor_lr, weight_decay.index_select(0, layout.group_of), kept)
    decay_factor(rate * layout.plain_mask, out=out.decay)
    torch.mul(rate, layout.cautious_mask, out=out.cautious)
    step_size(tensor_lr, kept, layout.neg_scale, index=layout.piece_tensor, out=out.step)
    torch.eq(found_inf, 0, out=out.ok)
    ok = out.ok.float()
    decay_factor(decay_rate(lr, weight_decay, ok), out=out.group_decay)
    class_lr = lr.index_select(0, layout.class_group)
    step_size(class_lr, ok, layout.class_neg_scale, out=out.class_step)
    if drop:
        torch.index_select(out.keep, 0, layout.stack_tensor, out=out.dropped)
        out.dropped.logical_not_()


def advance_momentum(
    grad: torch.Tensor, momentum: torch.Tensor, beta: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``β·momentum + grad`` in one torch pass (into ``out`` when given)."""
    return torch.add(grad, momentum, alpha=beta, out=out)


def advance_momenta(
    grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor], beta: float
) -> Sequence[torch.Tensor]:
    """:func:`advance_momentum` of every pair, in one foreach launch, as it is stored: a
    momentum kept in another dtype than its gradient (``momentum_dtype="bf16"``) is advanced
    in the wider of the two and rounded once to its own, so the Nesterov mix reads the
    momentum the step keeps."""
    advanced = torch._foreach_add(list(grads), list(momenta), alpha=beta)
    return [
        new if new.dtype == m.dtype else new.to(m.dtype)
        for new, m in zip(advanced, momenta, strict=True)
    ]


def momentum_input(grad: torch.Tensor, advanced: torch.Tensor, mix: float | None) -> torch.Tensor:
    """Newton–Schulz's input from an advanced momentum: ``g + mix·m``, or ``m``."""
    return advanced if mix is None else torch.add(grad, advanced, alpha=mix)


def ns_inputs_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    mix: float | None,
) -> None:
    """:func:`momentum_input` of every piece into ``outs``, computed in the wider of the
    gradient's and the momentum's dtype and cast on the copy; one foreach launch per step
    of the formula, however many pieces."""
    if mix is None:
        torch._foreach_copy_(list(outs), list(momenta))
    else:
        torch._foreach_copy_(list(outs), torch._foreach_add(list(grads), list(momenta), alpha=mix))


def store_momentum_(momentum: torch.Tensor, advanced: torch.Tensor, keep: torch.Tensor) -> None:
    """``momentum ← advanced`` where ``keep``; unchanged (bitwise) elsewhere."""
    torch.where(keep, advanced, momentum, out=momentum)


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


def matrix_sums(stack: torch.Tensor, out: torch.Tensor, backend: str = "torch") -> None:
    """``out[i]`` = the fp32 sum of matrix i of a ``[k, m, n]`` stack: finite exactly when
    the matrix is, for entries far below fp32's range. On CUDA (:func:`fused_form`) a
    Triton reduction over many programs per matrix, in a fixed order: torch's reads a stack
    of few large matrices with few programs, at well under the GPU's bandwidth."""
    if fused_form(backend, stack) and stack.dtype in TRITON_DTYPES:
        from muon_dist.kernels.triton_reduce import matrix_sums_triton

        matrix_sums_triton(stack, out=out)
        return
    torch.sum(stack, dim=(-2, -1), dtype=torch.float32, out=out)


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
