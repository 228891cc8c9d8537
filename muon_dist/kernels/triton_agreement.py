"""The agreement's decisions in one launch each: ``found_inf``, the ranks' difference and the
keep mask from the all-reduced flags, and the count of non-finite results per tensor.

Their torch forms (:mod:`muon_dist.step.agree.decisions`) are chains of up to a dozen
tiny launches on a few hundred values, each a few microseconds of a captured step's
critical path. These take the same inputs and write the same bits: maxima, comparisons and
additions of whole numbers, which round nowhere. Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import on_device

# Flags per loop iteration of the one program (a step has a few hundred to a few thousand).
_BLOCK = 1024
# Matrices per program of the count.
_COUNT_BLOCK = 1024


@triton.jit
def _max_of(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    ptr, count, BLOCK: tl.constexpr
):
    """The largest of ``count`` non-negative values at ``ptr`` (0 for none)."""
    worst = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, count, BLOCK):
        at = start + tl.arange(0, BLOCK)
        worst = tl.maximum(worst, tl.load(ptr + at, mask=at < count, other=0.0))
    return tl.max(worst, axis=0)


@triton.jit
def _any_spread(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    high_ptr, low_ptr, count, BLOCK: tl.constexpr
):
    """Whether ``high[i] + low[i] > 0`` for some i < ``count``."""
    over = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, count, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < count
        high = tl.load(high_ptr + at, mask=mask, other=0.0)
        low = tl.load(low_ptr + at, mask=mask, other=0.0)
        over = tl.maximum(over, (high + low > 0.0).to(tl.int32))
    return tl.max(over, axis=0) > 0


@triton.jit
def _settle_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    checked_ptr,
    values_ptr,
    negated_ptr,
    norms_ptr,
    negated_norms_ptr,
    digests_ptr,
    present_ptr,
    muon_index_ptr,
    found_inf_ptr,
    differs_ptr,
    keep_ptr,
    checked,
    values,
    norms,
    digests,
    tensors,
    COMPARE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``found_inf`` = min(1, max(checked)), raised to 1 where (COMPARE) the ranks' values
    or norms spread or their digests differ (``differs``); then ``keep[j]`` = some rank has
    Muon tensor j's gradient (``present[muon_index[j]] > 0``) and nothing was found."""
    found = tl.minimum(_max_of(checked_ptr, checked, BLOCK), 1.0)
    if COMPARE:
        spread = _any_spread(values_ptr, negated_ptr, values, BLOCK)
        spread = spread | _any_spread(norms_ptr, negated_norms_ptr, norms, BLOCK)
        high = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        low = tl.full((BLOCK,), float("inf"), dtype=tl.float32)
        for start in range(0, digests, BLOCK):
            at = start + tl.arange(0, BLOCK)
            mask = at < digests
            high = tl.maximum(high, tl.load(digests_ptr + at, mask=mask, other=float("-inf")))
            low = tl.minimum(low, tl.load(digests_ptr + at, mask=mask, other=float("inf")))
        differs = spread | (tl.max(high, axis=0) > tl.min(low, axis=0))
        tl.store(differs_ptr, differs)
        found = tl.maximum(found, differs.to(tl.float32))
    tl.store(found_inf_ptr, found)
    clear = tl.full((BLOCK,), 0.0, dtype=tl.float32) + found == 0.0
    for start in range(0, tensors, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < tensors
        position = tl.load(muon_index_ptr + at, mask=mask, other=0)
        present = tl.load(present_ptr + position, mask=mask, other=0.0)
        tl.store(keep_ptr + at, (present > 0.0) & clear, mask=mask)


def settle_triton(
    checked: torch.Tensor,
    present: torch.Tensor,
    muon_index: torch.Tensor,
    found_inf: torch.Tensor,
    keep: torch.Tensor,
    compared: dict[str, torch.Tensor] | None = None,
    differs: torch.Tensor | None = None,
) -> None:
    """One launch of one program: ``found_inf`` (fp32, one element) = min(1, max of the
    non-negative fp32 ``checked``, which may hold ``found_inf`` itself); where ``compared``
    is given (its ``values``, ``negated``, ``norms``, ``negated_norms`` and ``digests``,
    fp32), raised to 1 where ``values + negated`` or ``norms + negated_norms`` is positive
    somewhere or the digests differ, which ``differs`` (bool, one element, given with
    ``compared``) records; then the bool ``keep[j]`` = ``present[muon_index[j]] > 0`` and
    ``found_inf == 0``. Every tensor contiguous, on one device."""
    parts = compared or {}
    empty = checked[:0]
    with on_device(checked.device):
        _settle_kernel[(1,)](
            checked,
            parts.get("values", empty),
            parts.get("negated", empty),
            parts.get("norms", empty),
            parts.get("negated_norms", empty),
            parts.get("digests", empty),
            present,
            muon_index,
            found_inf,
            keep if differs is None else differs,
            keep,
            checked.numel(),
            parts["values"].numel() if compared else 0,
            parts["norms"].numel() if compared else 0,
            parts["digests"].numel() if compared else 0,
            keep.numel(),
            COMPARE=compared is not None,
            BLOCK=_BLOCK,
            num_warps=4,
        )


@triton.jit
def _count_bad_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    sums_ptr,
    dropped_ptr,
    tensor_ptr,
    results_ptr,
    matrices,
    DROPPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``results[tensor[i]] += 1`` for each matrix i whose sum is not finite (and, with
    DROPPED, that was not dropped)."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = at < matrices
    total = tl.load(sums_ptr + at, mask=mask, other=0.0)
    finite = tl.abs(total) < float("inf")  # false for inf and NaN
    if DROPPED:
        finite = finite | (tl.load(dropped_ptr + at, mask=mask, other=0) != 0)
    tensor = tl.load(tensor_ptr + at, mask=mask, other=0)
    ones = tl.full((BLOCK,), 1.0, dtype=tl.float32)
    tl.atomic_add(results_ptr + tensor, ones, mask=mask & ~finite, sem="relaxed")


def count_bad_triton(
    sums: torch.Tensor,
    tensors: torch.Tensor,
    results: torch.Tensor,
    dropped: torch.Tensor | None = None,
) -> None:
    """Add 1.0 to ``results[tensors[i]]`` (fp32) for each matrix i whose fp32 ``sums[i]``
    is not finite, leaving out the matrices ``dropped`` (bool) marks where given: one
    launch. The additions count whole numbers, so their order changes no bit."""
    matrices = sums.numel()
    if not matrices:
        return
    with on_device(sums.device):
        _count_bad_kernel[(triton.cdiv(matrices, _COUNT_BLOCK),)](
            sums,
            sums if dropped is None else dropped,
            tensors,
            results,
            matrices,
            DROPPED=dropped is not None,
            BLOCK=_COUNT_BLOCK,
            num_warps=4,
        )
