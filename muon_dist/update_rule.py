"""The Muon update rule, written once, as functions of one matrix's tensors.

Before Newton–Schulz (:func:`pre_orthogonalize_`): advance the momentum, ``m ← β·m + g``,
and write the orthogonalization input, ``g + μ·m`` (Nesterov) or ``m``. After it
(:func:`post_orthogonalize_`): cautious or decoupled weight decay, then the scaled update,
``W ← d·W + s·O``. Every scalar that follows the learning rate (``d``, ``s``, the cautious
rate) and the ``keep`` flag are one-element tensors in device memory, so neither the rule
nor a captured CUDA graph of it reads them on the host. Magma enters as a per-row ``s``
(its damping per matrix), cautious decay as a sign mask.

``keep`` is how the step obeys its agreement without a host branch: where it is 0 (no
gradient on any rank, or a non-finite gradient somewhere) the momentum and the weights
stay bitwise as they were, and the Newton–Schulz input is zero, which orthogonalizes to
zero. Each function has a torch form and a fused Triton form computing the same formula
in fp32; :func:`fused_form` is the one place that chooses between them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.flat import Span
from muon_dist.kernels.availability import triton_available

# Below this many elements the fused pass loses: a Triton launch costs about 20 us of CPU
# against 12-18 us for torch's two kernels, and a small piece moves few bytes either way. On
# an H200 (benchmarks/bench_elementwise.py, 2026-11-22) the two tie near 1M elements and the
# fused pass is 1.5x faster from 4M, up to 1.6x (momentum) and 2.3x (update) at 16M+.
FUSED_MIN_NUMEL = 1 << 21


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


def ns_inputs_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    mix: float | None,
) -> None:
    """Write Newton–Schulz's inputs from advanced momenta into ``outs``: ``g + mix·m``, or
    ``m`` when ``mix`` is None, computed in the momentum's dtype and cast on the copy; one
    foreach launch per step of the formula, however many pieces."""
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
    (:func:`mask_stack_`). The fused form is one Triton pass per tensor.
    """
    if fused:
        from muon_dist.kernels.triton_elementwise import momentum_input_triton

        for grad, momentum, out, keep in zip(grads, momenta, outs, keeps, strict=True):
            momentum_input_triton(grad, momentum, out, beta, mix, store, keep)
        return
    advanced = advance_momenta(grads, momenta, beta)
    if store:
        for momentum, new, keep in zip(momenta, advanced, keeps, strict=True):
            store_momentum_(momentum, new, keep)
    ns_inputs_(grads, advanced, outs, mix)


def mask_stack_(stack: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """Zero the matrices of a ``[k, m, n]`` stack that ``dropped`` (shape ``[k]``) marks."""
    return stack.masked_fill_(dropped.view(-1, 1, 1), 0.0)


def post_orthogonalize_(
    param: torch.Tensor,
    update: torch.Tensor,
    *,
    step: torch.Tensor,
    keep: torch.Tensor,
    decay: torch.Tensor | None = None,
    cautious: torch.Tensor | None = None,
    fused: bool = False,
) -> None:
    """``param ← d·param + step·update``.

    ``decay`` is given where this write also applies the decoupled decay (otherwise it ran
    over the whole tensor before); ``cautious`` is the rate of cautious decay, applied only
    where the update and the weight share a sign. ``step`` is one element, or one per row
    of ``param`` (Magma). Where ``keep`` is false the caller passes scalars with no effect
    (decay 1, step and cautious rate 0) and a finite update (:func:`mask_stack_` makes it
    zero), so the torch form needs no mask; the fused form also skips the write there.
    """
    if fused and decay is not None and cautious is None and step.numel() == 1:
        from muon_dist.kernels.triton_elementwise import decay_and_update_triton

        decay_and_update_triton(param, update, decay, step, keep)
        return
    if cautious is not None:
        same_sign = torch.sign(update) == torch.sign(param)
        param.sub_(param * same_sign * cautious)
    if decay is not None:
        param.mul_(decay)
    param.addcmul_(update, step)
