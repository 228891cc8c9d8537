"""Triton kernels for the memory-bound passes of a Muon step, one pass over memory each.

Torch needs two kernels for each of these passes, and its mixed-dtype adds (fp32 inputs,
bf16 output) are not vectorised. The passes a step runs on many pieces also come in a form
that takes them all in one launch, from a table of their addresses
(:mod:`muon_dist.kernels.tables`). Importing this module imports Triton; the optimizer
reaches it through :mod:`muon_dist.rules.ops` only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import on_device
from muon_dist.kernels.tables import address_table, tables_allowed
from muon_dist.kernels.triton_reduce import TL_DTYPES

_BLOCK = 4096
_WARPS = 8
# Launch options of the momentum and write passes: no contraction of a product and an add
# into one fused multiply-add unless the kernel asks for it (``tl.fma``), so each pass
# rounds where its torch form does and the two forms agree bitwise in fp32.
_UNFUSED = {"num_warps": _WARPS, "enable_fp_fusion": False}
# A step's scalars per loop iteration of their one program (a few hundred in all).
_SCALARS_BLOCK = 256


@triton.jit
def _momentum_input_block(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    grad_ptr,
    momentum_ptr,
    out_ptr,
    keep,
    offsets,
    mask,
    beta,
    mix,
    NESTEROV: tl.constexpr,
    STORE: tl.constexpr,
):
    """``m' = g + beta·m`` (stored when STORE and keep); ``out = g + mix·m'`` (NESTEROV) or
    ``m'``, and zero where keep is 0, so a masked matrix orthogonalizes to zero."""
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    stored = tl.load(momentum_ptr + offsets, mask=mask)
    # Round the new momentum to its storage dtype before the mix, as two torch adds would
    # (a bf16 momentum under momentum_dtype="bf16": read widened, advanced in fp32). Each
    # add is one fused multiply-add, as torch's ``add(alpha=)`` is on CUDA.
    momentum = tl.fma(stored.to(tl.float32), beta, grad).to(momentum_ptr.dtype.element_ty)
    if STORE:
        tl.store(momentum_ptr + offsets, tl.where(keep, momentum, stored), mask=mask)
    if NESTEROV:
        update = tl.fma(momentum.to(tl.float32), mix, grad)
    else:
        update = momentum.to(tl.float32)
    update = tl.where(keep, update, 0.0)
    tl.store(out_ptr + offsets, update.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _momentum_input_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    grad_ptr,
    momentum_ptr,
    out_ptr,
    keep_ptr,
    numel,
    beta,
    mix,
    NESTEROV: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`_momentum_input_block` over one tensor."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.load(keep_ptr) != 0
    _momentum_input_block(
        grad_ptr, momentum_ptr, out_ptr, keep, offsets, offsets < numel, beta, mix, NESTEROV, STORE
    )


@triton.jit
def _momentum_inputs_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    table_ptr,
    beta,
    mix,
    GRAD: tl.constexpr,
    MOMENTUM: tl.constexpr,
    OUT: tl.constexpr,
    NESTEROV: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`_momentum_input_block` over many tensors: program (i, j) takes every
    ``programs``-th block of the i-th row of ``table`` (grad, momentum, out and keep
    addresses, numel)."""
    row = table_ptr + tl.program_id(0) * 5
    grad_ptr = tl.load(row).to(tl.pointer_type(GRAD))
    momentum_ptr = tl.load(row + 1).to(tl.pointer_type(MOMENTUM))
    out_ptr = tl.load(row + 2).to(tl.pointer_type(OUT))
    keep = tl.load(tl.load(row + 3).to(tl.pointer_type(tl.int8))) != 0
    numel = tl.load(row + 4)
    stride = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(tl.program_id(1).to(tl.int64) * BLOCK, numel, stride):
        offsets = start + tl.arange(0, BLOCK)
        _momentum_input_block(
            grad_ptr,
            momentum_ptr,
            out_ptr,
            keep,
            offsets,
            offsets < numel,
            beta,
            mix,
            NESTEROV,
            STORE,
        )


@triton.jit
def _decay_and_update_block(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    param_ptr,
    update_ptr,
    momentum_ptr,
    decay,
    step,
    keep,
    beta,
    offsets,
    mask,
    FEEDBACK: tl.constexpr,
):
    """``p = decay·p + step·u`` where keep, computed in fp32 and stored in the parameter's
    dtype. With FEEDBACK, also Dion2's error feedback (:func:`_decay_selected`) on the
    momentum, from the same read of the update.

    Rounded after each product and the sum, as the batched torch write's decay, scale and
    add are (:func:`muon_dist.rules.ops.shared_step_updates_`; launched with
    :data:`_UNFUSED`, so the compiler contracts no product into the add)."""
    stored = tl.load(param_ptr + offsets, mask=mask)
    update = tl.load(update_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    decayed = decay * stored.to(tl.float32)
    scaled = step * update
    param = (decayed + scaled).to(param_ptr.dtype.element_ty)
    tl.store(param_ptr + offsets, tl.where(keep, param, stored), mask=mask)
    if FEEDBACK:
        _decay_selected(momentum_ptr, offsets, mask, update, beta, keep)


@triton.jit
def _decay_and_update_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    param_ptr,
    update_ptr,
    decay_ptr,
    step_ptr,
    keep_ptr,
    momentum_ptr,
    beta,
    numel,
    FEEDBACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`_decay_and_update_block` over one tensor; the scalars are read from device
    memory, so a captured graph follows the lr."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _decay_and_update_block(
        param_ptr,
        update_ptr,
        momentum_ptr,
        tl.load(decay_ptr).to(tl.float32),
        tl.load(step_ptr).to(tl.float32),
        tl.load(keep_ptr) != 0,
        beta,
        offsets,
        offsets < numel,
        FEEDBACK,
    )


@triton.jit
def _decay_and_updates_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    table_ptr,
    beta,
    PARAM: tl.constexpr,
    UPDATE: tl.constexpr,
    MOMENTUM: tl.constexpr,
    FEEDBACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`_decay_and_update_block` over many tensors: program (i, j) takes every
    ``programs``-th block of the i-th row of ``table`` (param, update, momentum, decay,
    step and keep addresses, numel)."""
    row = table_ptr + tl.program_id(0) * 7
    param_ptr = tl.load(row).to(tl.pointer_type(PARAM))
    update_ptr = tl.load(row + 1).to(tl.pointer_type(UPDATE))
    momentum_ptr = tl.load(row + 2).to(tl.pointer_type(MOMENTUM))
    decay = tl.load(tl.load(row + 3).to(tl.pointer_type(tl.float32)))
    step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
    keep = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.int8))) != 0
    numel = tl.load(row + 6)
    stride = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(tl.program_id(1).to(tl.int64) * BLOCK, numel, stride):
        offsets = start + tl.arange(0, BLOCK)
        _decay_and_update_block(
            param_ptr,
            update_ptr,
            momentum_ptr,
            decay,
            step,
            keep,
            beta,
            offsets,
            offsets < numel,
            FEEDBACK,
        )


@triton.jit
def _decay_selected(momentum_ptr, offsets, mask, update, beta, keep):  # type: ignore[no-untyped-def]
    """``m = β·m`` where the update is nonzero or a negative zero (Dion2's selected slices)
    and keep; computed in fp32, rounded once to m's dtype. The entries left out are
    neither read nor written (three quarters of them at Dion2's default fraction)."""
    # A negative zero (sign bit set) marks a selected entry, a positive one does not.
    selected = ((update != 0.0) | (update.to(tl.int32, bitcast=True) < 0)) & mask
    selected = tl.where(keep, selected, False)
    stored = tl.load(momentum_ptr + offsets, mask=selected)
    decayed = (stored.to(tl.float32) * beta).to(momentum_ptr.dtype.element_ty)
    tl.store(momentum_ptr + offsets, decayed, mask=selected)


@triton.jit
def _zero_dropped_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    x_ptr,
    dropped_ptr,
    per_matrix,
    BLOCK: tl.constexpr,
):
    """Zero the matrices of a contiguous stack that ``dropped`` marks: program (i, j) takes
    every ``programs``-th block of matrix i, and a kept matrix is neither read nor written."""
    matrix = tl.program_id(0).to(tl.int64)
    if tl.load(dropped_ptr + matrix) != 0:
        zeros = tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty)
        stride = tl.num_programs(1).to(tl.int64) * BLOCK
        for start in range(tl.program_id(1).to(tl.int64) * BLOCK, per_matrix, stride):
            offsets = start + tl.arange(0, BLOCK)
            tl.store(x_ptr + matrix * per_matrix + offsets, zeros, mask=offsets < per_matrix)


@triton.jit
def _scale_rows_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    x_ptr,
    factor_ptr,
    numel,
    rows,
    cols,
    COLUMNS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``x[b, i, j] *= f[b, i]`` (``f[b, j]`` with COLUMNS) in place on a contiguous
    ``[B, rows, cols]`` tensor, the product taken in fp32 and rounded once to x's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    if COLUMNS:
        index = (offsets // (rows * cols)) * cols + offsets % cols
    else:
        index = offsets // cols
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    factor = tl.load(factor_ptr + index, mask=mask)
    tl.store(x_ptr + offsets, (x * factor).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _error_feedback_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    momentum_ptr,
    update_ptr,
    keep_ptr,
    numel,
    beta,
    BLOCK: tl.constexpr,
):
    """Dion2's error feedback alone (:func:`_decay_selected`)."""
    keep = tl.load(keep_ptr) != 0
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    update = tl.load(update_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    _decay_selected(momentum_ptr, offsets, mask, update, beta, keep)


@triton.jit
def _slice_l1_sums(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    x_ptr,
    batch,
    index,
    slices,
    length,
    first,
    last,
    batch_stride,
    slice_stride,
    step_stride,
    LAYOUT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """``Σ_l |x[batch, s, l]|`` over ``first <= l < last`` in float64 for the slices ``s``
    in ``index``, in a fixed order. LAYOUT tells the compiler which stride is 1, so its
    loads run along memory: 1, each slice's steps (rows); 2, the slices (columns); 0,
    neither (any strides)."""
    base = batch * batch_stride
    if LAYOUT == 2:
        rows = base + index.to(tl.int64)[:, None]
    else:
        rows = base + index.to(tl.int64)[:, None] * slice_stride
    total = tl.zeros((BLOCK_S,), dtype=tl.float64)
    for start in range(first, last, BLOCK_L):
        steps = start + tl.arange(0, BLOCK_L)
        inside = (index[:, None] < slices) & (steps[None, :] < length)
        if LAYOUT == 1:
            at = rows + steps.to(tl.int64)[None, :]
        else:
            at = rows + steps.to(tl.int64)[None, :] * step_stride
        values = tl.load(x_ptr + at, mask=inside)
        total += tl.sum(tl.abs(values.to(tl.float64)), axis=1)
    return total


@triton.jit
def _slice_l1_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    x_ptr,
    out_ptr,
    slices,
    length,
    batch_stride,
    slice_stride,
    step_stride,
    LAYOUT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """``out[b, s] = Σ_l |x[b, s, l]|`` (:func:`_slice_l1_sums`)."""
    batch = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    total = _slice_l1_sums(
        x_ptr,
        batch,
        index,
        slices,
        length,
        0,
        length,
        batch_stride,
        slice_stride,
        step_stride,
        LAYOUT,
        BLOCK_S,
        BLOCK_L,
    )
    tl.store(out_ptr + batch * slices + index, total, mask=index < slices)


@triton.jit
def _slice_l1_tiles_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    table_ptr,
    out_ptr,
    X: tl.constexpr,
    LAYOUT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """``out[slots[b, s]] += Σ_l |x[b, s, l]|`` for many tensors ``x`` of one LAYOUT
    (:func:`_slice_l1_sums`): program (i, j) takes every ``programs``-th block of slices
    and CHUNK steps of the i-th row of ``table`` (x and slots addresses, matrices, slices,
    length, strides). Atomic adds: the slices of several pieces, and the chunks of one
    slice, share a slot, and float64 sums of bf16 values are exact in any order."""
    row = table_ptr + tl.program_id(0) * 8
    x_ptr = tl.load(row).to(tl.pointer_type(X))
    slots_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    matrices = tl.load(row + 2)
    slices = tl.load(row + 3)
    length = tl.load(row + 4)
    batch_stride = tl.load(row + 5)
    slice_stride = tl.load(row + 6)
    step_stride = tl.load(row + 7)
    chunks = tl.cdiv(length, CHUNK)
    per_matrix = tl.cdiv(slices, BLOCK_S) * chunks
    for block in range(tl.program_id(1).to(tl.int64), matrices * per_matrix, tl.num_programs(1)):
        batch = block // per_matrix
        first = (block % chunks) * CHUNK
        index = (block % per_matrix) // chunks * BLOCK_S + tl.arange(0, BLOCK_S)
        total = _slice_l1_sums(
            x_ptr,
            batch,
            index,
            slices,
            length,
            first,
            tl.minimum(first + CHUNK, length),
            batch_stride,
            slice_stride,
            step_stride,
            LAYOUT,
            BLOCK_S,
            BLOCK_L,
        )
        inside = index < slices
        slot = tl.load(slots_ptr + batch * slices + index, mask=inside, other=0)
        tl.atomic_add(out_ptr + slot, total, mask=inside)


@triton.jit
def _row_denominators(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    squares_ptr,
    index_ptr,
    current_ptr,
    beta2_ptr,
    weight_ptr,
    eps_ptr,
    first,
    start,
    rows,
    BLOCK: tl.constexpr,
):
    """A block of a matrix's rows from ``start`` on: their offsets, mask, sums of squares
    ``s``, places in the per-row vectors, and ``√v + ε`` with ``v = v₀·β₂ + s·w``."""
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < rows
    squares = tl.load(squares_ptr + first + offsets, mask=mask, other=0.0)
    index = tl.load(index_ptr + first + offsets, mask=mask, other=0)
    moment = tl.load(current_ptr + index, mask=mask, other=0.0) * tl.load(
        beta2_ptr + index, mask=mask, other=0.0
    ) + squares * tl.load(weight_ptr + index, mask=mask, other=0.0)
    denom = tl.sqrt(moment) + tl.load(eps_ptr + index, mask=mask, other=1.0)
    return offsets, mask, squares, index, denom


@triton.jit
def _row_factors_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    squares_ptr,
    index_ptr,
    current_ptr,
    beta2_ptr,
    weight_ptr,
    eps_ptr,
    primary_ptr,
    sums_ptr,
    factor_ptr,
    rows,
    tiny,
    HAS_PRIMARY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One matrix per program: its rows' next second moments ``v``, the factors
    ``√(Σ s / Σ s/(√v+ε)²) / (√v+ε)`` and its rows' sums of squares ``s`` reported at
    their places in ``sums`` (zero where the matrix is not primary); fp32 throughout.
    Two passes over the rows: the sums, then the factors."""
    matrix = tl.program_id(0).to(tl.int64)
    first = matrix * rows
    before = tl.zeros((BLOCK,), dtype=tl.float32)
    after = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, rows, BLOCK):
        _, mask, squares, index, denom = _row_denominators(
            squares_ptr,
            index_ptr,
            current_ptr,
            beta2_ptr,
            weight_ptr,
            eps_ptr,
            first,
            start,
            rows,
            BLOCK,
        )
        before += squares
        after += squares / (denom * denom)
        if HAS_PRIMARY:
            report = tl.load(primary_ptr + matrix) != 0
            tl.store(sums_ptr + index, tl.where(report, squares, 0.0), mask=mask)
        else:
            tl.store(sums_ptr + index, squares, mask=mask)
    ratio = tl.sqrt(tl.sum(before, axis=0) / tl.maximum(tl.sum(after, axis=0), tiny))
    for start in range(0, rows, BLOCK):
        offsets, mask, _, _, denom = _row_denominators(
            squares_ptr,
            index_ptr,
            current_ptr,
            beta2_ptr,
            weight_ptr,
            eps_ptr,
            first,
            start,
            rows,
            BLOCK,
        )
        tl.store(factor_ptr + first + offsets, ratio / denom, mask=mask)


@triton.jit
def _step_scalars_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    lr_ptr,
    wd_ptr,
    keep_in_ptr,
    found_inf_ptr,
    group_of_ptr,
    plain_ptr,
    cautious_mask_ptr,
    piece_tensor_ptr,
    neg_scale_ptr,
    class_group_ptr,
    class_neg_scale_ptr,
    stack_tensor_ptr,
    keep_ptr,
    decay_ptr,
    cautious_ptr,
    step_ptr,
    ok_ptr,
    group_decay_ptr,
    class_step_ptr,
    dropped_ptr,
    tensors,
    pieces,
    groups,
    classes,
    matrices,
    DROP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Every scalar of :func:`muon_dist.rules.ops.stage_scalars_` in one program: a step
    has a few hundred of them, so one launch beats one per op. Each product is rounded in
    the order the torch form rounds it (no fused multiply-add: ``_UNFUSED``)."""
    ok = tl.load(found_inf_ptr) == 0.0
    ok_value = ok.to(tl.float32)
    tl.store(ok_ptr, ok)
    for start in range(0, tensors, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < tensors
        kept = tl.load(keep_in_ptr + at, mask=mask, other=0) != 0
        tl.store(keep_ptr + at, kept, mask=mask)
        group = tl.load(group_of_ptr + at, mask=mask, other=0)
        lr = tl.load(lr_ptr + group, mask=mask, other=0.0)
        rate = lr * tl.load(wd_ptr + group, mask=mask, other=0.0) * kept.to(tl.float32)
        plain = tl.load(plain_ptr + at, mask=mask, other=0.0)
        tl.store(decay_ptr + at, 1.0 - rate * plain, mask=mask)
        cautious = tl.load(cautious_mask_ptr + at, mask=mask, other=0.0)
        tl.store(cautious_ptr + at, rate * cautious, mask=mask)
    for start in range(0, pieces, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < pieces
        tensor = tl.load(piece_tensor_ptr + at, mask=mask, other=0)
        kept = tl.load(keep_in_ptr + tensor, mask=mask, other=0) != 0
        lr = tl.load(lr_ptr + tl.load(group_of_ptr + tensor, mask=mask, other=0), mask=mask)
        scale = tl.load(neg_scale_ptr + at, mask=mask, other=0.0)
        tl.store(step_ptr + at, lr * kept.to(tl.float32) * scale, mask=mask)
    for start in range(0, groups, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < groups
        lr = tl.load(lr_ptr + at, mask=mask, other=0.0)
        rate = lr * tl.load(wd_ptr + at, mask=mask, other=0.0) * ok_value
        tl.store(group_decay_ptr + at, 1.0 - rate, mask=mask)
    for start in range(0, classes, BLOCK):
        at = start + tl.arange(0, BLOCK)
        mask = at < classes
        lr = tl.load(lr_ptr + tl.load(class_group_ptr + at, mask=mask, other=0), mask=mask)
        scale = tl.load(class_neg_scale_ptr + at, mask=mask, other=0.0)
        tl.store(class_step_ptr + at, lr * ok_value * scale, mask=mask)
    if DROP:
        for start in range(0, matrices, BLOCK):
            at = start + tl.arange(0, BLOCK)
            mask = at < matrices
            tensor = tl.load(stack_tensor_ptr + at, mask=mask, other=0)
            kept = tl.load(keep_in_ptr + tensor, mask=mask, other=0) != 0
            tl.store(dropped_ptr + at, kept == 0, mask=mask)


def _grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _BLOCK),)


class _Flat:
    """Contiguous stand-ins for the strided operands of one fused pass. The kernels read an
    operand as ``numel`` consecutive elements from its address, which a strided piece (cut
    across a shard's rows, or its region in a stack) is not: it is read through a contiguous
    copy, and one the pass writes is copied back after the launch (:meth:`copy_back`). The
    copies live as long as this object: an address table holds only their addresses."""

    def __init__(self) -> None:
        self._copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []

    def __call__(self, t: torch.Tensor, written: bool) -> torch.Tensor:
        if t.is_contiguous():
            return t
        flat = t.contiguous()
        self._copies.append((t, flat, written))
        return flat

    def copy_back(self) -> None:
        for t, flat, written in self._copies:
            if written:
                t.copy_(flat)


def momentum_input_triton(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    out: torch.Tensor,
    beta: float,
    mix: float | None,
    store: bool,
    keep: torch.Tensor,
) -> None:
    """Fused form of :func:`muon_dist.rules.ops.pre_orthogonalize_` (same-shape tensors on
    one device, strided ones through :class:`_Flat`; ``keep`` a one-element tensor there)."""
    numel = grad.numel()
    if numel == 0:
        return
    flat = _Flat()
    with on_device(grad.device):
        _momentum_input_kernel[_grid(numel)](
            flat(grad, False),
            flat(momentum, store),
            flat(out, True),
            keep,
            numel,
            float(beta),
            float(mix or 0.0),
            NESTEROV=mix is not None,
            STORE=store,
            BLOCK=_BLOCK,
            **_UNFUSED,
        )
    flat.copy_back()


def decay_and_update_triton(
    param: torch.Tensor,
    update: torch.Tensor,
    decay: torch.Tensor,
    step: torch.Tensor,
    keep: torch.Tensor,
    feedback: tuple[torch.Tensor, float] | None = None,
) -> None:
    """Fused form of :func:`muon_dist.rules.ops.post_orthogonalize_` with the decay
    (one-element fp32 tensors ``decay``, ``step`` and ``keep`` on the tensors' device) and,
    given a ``feedback`` momentum and β, Dion2's error feedback in the same pass."""
    numel = param.numel()
    if numel == 0:
        return
    flat = _Flat()
    target = flat(param, True)
    momentum, beta = (flat(feedback[0], True), feedback[1]) if feedback else (target, 0.0)
    with on_device(param.device):
        _decay_and_update_kernel[_grid(numel)](
            target,
            flat(update, False),
            decay,
            step,
            keep,
            momentum,
            float(beta),
            numel,
            FEEDBACK=feedback is not None,
            BLOCK=_BLOCK,
            **_UNFUSED,
        )
    flat.copy_back()


# Programs per tensor of a many-tensor launch; each takes every _PROGRAMS-th block of its
# tensor, so a small tensor's surplus programs return at once.
_PROGRAMS = 1024


def _launch_tables(
    kernel: triton.JITFunction,
    batches: dict[tuple[Any, ...], list[list[int]]],
    device: torch.device,
    args: Callable[[tuple[Any, ...]], dict[str, Any]],
) -> None:
    """One launch of ``kernel`` per batch of table rows (the last entry of a row: its
    numel); ``args`` gives a batch key's other arguments."""
    with on_device(device):
        for key, rows in batches.items():
            programs = min(triton.cdiv(max(row[-1] for row in rows), _BLOCK), _PROGRAMS)
            kernel[(len(rows), programs)](
                address_table(rows, device), **args(key), BLOCK=_BLOCK, **_UNFUSED
            )


def momentum_inputs_triton(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    beta: float,
    mix: float | None,
    store: bool,
    keeps: Sequence[torch.Tensor],
) -> None:
    """:func:`momentum_input_triton` on every piece, one launch per dtypes of (grad,
    momentum, out); one per piece where no address table may be made
    (:func:`~muon_dist.kernels.tables.tables_allowed`: a graph captured outside the
    optimizer's captured step)."""
    if not grads:
        return
    device = grads[0].device
    if not tables_allowed(device):
        for grad, momentum, out, keep in zip(grads, momenta, outs, keeps, strict=True):
            momentum_input_triton(grad, momentum, out, beta, mix, store, keep)
        return
    batches: dict[tuple[Any, ...], list[list[int]]] = {}
    flat = _Flat()
    for grad, momentum, out, keep in zip(grads, momenta, outs, keeps, strict=True):
        if grad.numel():
            batches.setdefault((grad.dtype, momentum.dtype, out.dtype), []).append(
                [
                    flat(grad, False).data_ptr(),
                    flat(momentum, store).data_ptr(),
                    flat(out, True).data_ptr(),
                    keep.data_ptr(),
                    grad.numel(),
                ]
            )
    _launch_tables(
        _momentum_inputs_kernel,
        batches,
        device,
        lambda key: {
            "beta": float(beta),
            "mix": float(mix or 0.0),
            "GRAD": TL_DTYPES[key[0]],
            "MOMENTUM": TL_DTYPES[key[1]],
            "OUT": TL_DTYPES[key[2]],
            "NESTEROV": mix is not None,
            "STORE": store,
        },
    )
    flat.copy_back()


def decay_and_updates_triton(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    decays: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    keeps: Sequence[torch.Tensor],
    feedbacks: Sequence[tuple[torch.Tensor, float] | None],
) -> None:
    """:func:`decay_and_update_triton` on every piece, one launch per dtypes and feedback
    β; one per piece where no address table may be made (as
    :func:`momentum_inputs_triton`)."""
    if not params:
        return
    device = params[0].device
    pieces = zip(params, updates, decays, steps, keeps, feedbacks, strict=True)
    if not tables_allowed(device):
        for param, update, decay, step, keep, feedback in pieces:
            decay_and_update_triton(param, update, decay, step, keep, feedback)
        return
    batches: dict[tuple[Any, ...], list[list[int]]] = {}
    flat = _Flat()
    for param, update, decay, step, keep, feedback in pieces:
        if not param.numel():
            continue
        target = flat(param, True)
        momentum, beta = (flat(feedback[0], True), feedback[1]) if feedback else (target, None)
        key = (param.dtype, update.dtype, momentum.dtype, beta)
        batches.setdefault(key, []).append(
            [
                target.data_ptr(),
                flat(update, False).data_ptr(),
                momentum.data_ptr(),
                decay.data_ptr(),
                step.data_ptr(),
                keep.data_ptr(),
                param.numel(),
            ]
        )
    _launch_tables(
        _decay_and_updates_kernel,
        batches,
        device,
        lambda key: {
            "beta": float(key[3] or 0.0),
            "PARAM": TL_DTYPES[key[0]],
            "UPDATE": TL_DTYPES[key[1]],
            "MOMENTUM": TL_DTYPES[key[2]],
            "FEEDBACK": key[3] is not None,
        },
    )
    flat.copy_back()


def zero_dropped_triton(stack: torch.Tensor, dropped: torch.Tensor) -> None:
    """Fused form of :func:`muon_dist.rules.ops.mask_stack_` (``stack`` contiguous
    ``[k, m, n]``, ``dropped`` ``[k]`` on its device): only the dropped matrices are
    written, where a masked fill reads and writes the whole stack."""
    k = stack.shape[0]
    per_matrix = stack[0].numel() if k else 0
    if k * per_matrix == 0:
        return
    with on_device(stack.device):
        _zero_dropped_kernel[(k, min(triton.cdiv(per_matrix, _BLOCK), _PROGRAMS))](
            stack, dropped, per_matrix, BLOCK=_BLOCK, num_warps=_WARPS
        )


def scale_rows_triton(x: torch.Tensor, factors: torch.Tensor, columns: bool) -> None:
    """Fused form of :func:`muon_dist.rules.normuon_rows.scale_rows_` (``x`` contiguous
    ``[..., rows, cols]``, ``factors`` fp32 ``[..., rows]``, or ``[..., cols]`` with
    ``columns``, on x's device)."""
    numel = x.numel()
    if numel == 0:
        return
    rows, cols = x.shape[-2], x.shape[-1]
    with on_device(x.device):
        _scale_rows_kernel[_grid(numel)](
            x,
            factors.contiguous(),
            numel,
            rows,
            cols,
            COLUMNS=columns,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )


def error_feedback_triton(
    momentum: torch.Tensor, update: torch.Tensor, beta: float, keep: torch.Tensor
) -> None:
    """Fused form of :func:`muon_dist.rules.ops.error_feedback_` (contiguous, same-shape
    tensors on one device; ``keep`` a one-element tensor there)."""
    numel = momentum.numel()
    if numel == 0:
        return
    with on_device(momentum.device):
        _error_feedback_kernel[_grid(numel)](
            momentum, update, keep, numel, float(beta), BLOCK=_BLOCK, num_warps=_WARPS
        )


def _slice_geometry(x: torch.Tensor, axis: int) -> tuple[int, int, int, int, int, int]:
    """Matrices, slices, length and the batch, slice and step strides of ``x``'s slices."""
    k, m, n = x.shape
    if axis == -2:
        return k, m, n, x.stride(0), x.stride(1), x.stride(2)
    return k, n, m, x.stride(0), x.stride(2), x.stride(1)


def _slice_layout(strides: Sequence[int]) -> int:
    """The LAYOUT of :func:`_slice_l1_sums` for (batch, slice, step) ``strides``."""
    return 1 if strides[2] == 1 else 2 if strides[1] == 1 else 0


_SLICE_BLOCK = 64
# Steps of a slice per program of the many-tensor pass: long slices spread over programs.
_SLICE_CHUNK = 1024


def slice_l1_triton(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Fused form of :func:`muon_dist.rules.dion2_slices.slice_norms`: the float64 L1 norm of each
    row (``axis=-2``) or column (``axis=-1``) of each matrix of a ``[k, m, n]`` tensor,
    read in place whatever its strides."""
    k, slices, length, *strides = _slice_geometry(x, axis)
    out = torch.empty(k, slices, dtype=torch.float64, device=x.device)
    if out.numel() == 0:
        return out
    with on_device(x.device):
        _slice_l1_kernel[(k, triton.cdiv(slices, _SLICE_BLOCK))](
            x,
            out,
            slices,
            length,
            *strides,
            LAYOUT=_slice_layout(strides),
            BLOCK_S=_SLICE_BLOCK,
            BLOCK_L=64,
            num_warps=4,
        )
    return out


def add_slice_l1_triton(
    norms: torch.Tensor,
    xs: Sequence[torch.Tensor],
    axes: Sequence[int],
    slots: Sequence[torch.Tensor],
) -> None:
    """Fused form of :func:`muon_dist.rules.dion2_slices.add_slice_norms_`: every ``[k, m, n]``
    tensor's slice norms (as :func:`slice_l1_triton`) added into ``norms`` at its ``[k,
    slices]`` int64 slots, one launch per dtype and layout of the tensors. Only where
    :func:`~muon_dist.kernels.tables.tables_allowed`."""
    batches: dict[tuple[torch.dtype, int], list[list[int]]] = {}
    for x, axis, where in zip(xs, axes, slots, strict=True):
        k, slices, length, *strides = _slice_geometry(x, axis)
        if k * slices:
            layout = _slice_layout(strides)
            row = [x.data_ptr(), where.data_ptr(), k, slices, length, *strides]
            batches.setdefault((x.dtype, layout), []).append(row)
    with on_device(norms.device):
        for (dtype, layout), rows in batches.items():
            blocks = max(
                row[2] * triton.cdiv(row[3], _SLICE_BLOCK) * triton.cdiv(row[4], _SLICE_CHUNK)
                for row in rows
            )
            _slice_l1_tiles_kernel[(len(rows), min(blocks, _PROGRAMS))](
                address_table(rows, norms.device),
                norms,
                X=TL_DTYPES[dtype],
                LAYOUT=layout,
                BLOCK_S=_SLICE_BLOCK,
                BLOCK_L=64,
                CHUNK=_SLICE_CHUNK,
                num_warps=4,
            )


def row_factors_triton(
    squares: torch.Tensor,
    index: torch.Tensor,
    current: torch.Tensor,
    beta2: torch.Tensor,
    weight: torch.Tensor,
    eps: torch.Tensor,
    primary: torch.Tensor | None,
    sums: torch.Tensor,
) -> torch.Tensor:
    """Fused form of NorMuon's factors (:func:`muon_dist.rules.normuon_rows.second_moment_next`
    then :func:`muon_dist.rules.normuon_rows.row_factors`) for ``[k, m]`` fp32 ``squares`` whose
    rows lie at ``index`` in the per-row vectors, also writing the squares to ``sums``
    there (zero for matrices not ``primary``): one launch instead of about twenty."""
    k, m = squares.shape
    factors = torch.empty_like(squares)
    if squares.numel() == 0:
        return factors
    with on_device(squares.device):
        _row_factors_kernel[(k,)](
            squares.contiguous(),
            index.contiguous(),
            current,
            beta2,
            weight,
            eps,
            (primary if primary is not None else squares).reshape(-1),
            sums,
            factors,
            m,
            torch.finfo(torch.float32).tiny,
            HAS_PRIMARY=primary is not None,
            BLOCK=1024,
            num_warps=4,
        )
    return factors


def step_scalars_triton(
    sources: dict[str, torch.Tensor],
    layout: dict[str, torch.Tensor],
    out: dict[str, torch.Tensor],
    drop: bool,
) -> None:
    """Fused form of :func:`muon_dist.rules.ops.stage_scalars_`, one launch of one program.
    Its tensors by name (each contiguous, all on one device): ``sources`` ``lr``,
    ``weight_decay``, ``keep`` and ``found_inf``; ``layout`` and ``out`` the fields of
    ``ScalarLayout`` and ``StepScalars``."""
    dropped = out["dropped"]
    with on_device(sources["lr"].device):
        _step_scalars_kernel[(1,)](
            sources["lr"],
            sources["weight_decay"],
            sources["keep"],
            sources["found_inf"],
            layout["group_of"],
            layout["plain_mask"],
            layout["cautious_mask"],
            layout["piece_tensor"],
            layout["neg_scale"],
            layout["class_group"],
            layout["class_neg_scale"],
            layout["stack_tensor"],
            out["keep"],
            out["decay"],
            out["cautious"],
            out["step"],
            out["ok"],
            out["group_decay"],
            out["class_step"],
            dropped,
            out["keep"].numel(),
            out["step"].numel(),
            out["group_decay"].numel(),
            out["class_step"].numel(),
            dropped.numel(),
            DROP=drop,
            BLOCK=_SCALARS_BLOCK,
            **_UNFUSED,
        )
