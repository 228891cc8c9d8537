"""Per-matrix sums and sums of squares of a stack in Triton, in a fixed order on many programs,
and the float64 norms of many tensors at once, with the agreement's verdict on each.

Torch reduces each matrix with few programs, which leaves most of a GPU idle for a stack of
one to eight large matrices. Here every matrix is cut into chunks that depend on its size
alone, one program each (pass 1 writes their fp32 partials); a second, tiny pass sums each
matrix's partials. No atomics: the same input gives the same bits on every run, and a
matrix is cut the same way in any stack. The many-tensor norms read the tensors from an
address table the same way, a fixed set of programs per tensor. Importing this module
imports Triton; the Newton–Schulz driver, :mod:`muon_dist.rules.ops` and the agreement
import it lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import on_device
from muon_dist.kernels.tables import address_table

# Elements a program loads per loop step: 32 per thread at 8 warps, as 16-byte vectors.
_BLOCK = 8192
_WARPS = 8
# Chunks per matrix (up to twice as many for matrices under 2·_CHUNKS blocks): a 4096²
# matrix alone spreads over 1024 programs, about 8 per SM of an H100 (132 SMs).
_CHUNKS = 1024
# Partials the second pass loads per loop step.
_TOTALS_BLOCK = 1024


@triton.jit
def _chunk_sums_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    x_ptr,
    partials_ptr,
    per_matrix,
    matrix_stride,
    chunk,
    chunks,
    SQUARES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``partials[p] = Σ x`` (``Σ x²`` with SQUARES) in fp32 over chunk ``p % chunks`` of
    matrix ``p // chunks`` (``chunk`` a multiple of BLOCK elements, so no block of a chunk
    reaches into the next one)."""
    program = tl.program_id(0).to(tl.int64)
    matrix = program // chunks
    first = (program % chunks) * chunk
    base = x_ptr + matrix * matrix_stride
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(first, tl.minimum(first + chunk, per_matrix), BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < per_matrix, other=0.0).to(tl.float32)
        if SQUARES:
            total += x * x
        else:
            total += x
    tl.store(partials_ptr + program, tl.sum(total, axis=0))


@triton.jit
def _matrix_totals_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    partials_ptr,
    out_ptr,
    squares_ptr,
    chunks,
    norm_scale,
    eps,
    INVERSE_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[i]`` = the sum of matrix i's ``chunks`` partials, in a fixed order; with
    INVERSE_NORM, ``1 / (norm_scale·√sum + eps)`` (IEEE square root and division), and its
    square in ``squares[i]``."""
    matrix = tl.program_id(0).to(tl.int64)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, chunks, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += tl.load(partials_ptr + matrix * chunks + offsets, mask=offsets < chunks, other=0.0)
    value = tl.sum(total, axis=0)
    if INVERSE_NORM:
        value = tl.div_rn(1.0, tl.sqrt_rn(value) * norm_scale + eps)
        tl.store(squares_ptr + matrix, value * value)
    tl.store(out_ptr + matrix, value)


def _chunking(per_matrix: int) -> tuple[int, int]:
    """Elements per chunk (a multiple of ``_BLOCK``) and chunks per matrix: the size alone
    decides them, so a matrix sums in the same order in any stack."""
    chunk = max(1, triton.cdiv(per_matrix, _BLOCK) // _CHUNKS) * _BLOCK
    return chunk, triton.cdiv(per_matrix, chunk)


def _matrix_rows(x: torch.Tensor, per_matrix: int) -> torch.Tensor:
    """``x`` as ``[k, m·n]`` rows of unit element stride: a view where each matrix fills a
    dense block of memory, row- or column-major (a sum reads its elements in any order),
    and a contiguous copy otherwise."""
    for candidate in (x, x.mT):
        try:
            rows = candidate.view(-1, per_matrix)
        except RuntimeError:
            continue
        if per_matrix == 1 or rows.stride(1) == 1:
            return rows
    return x.contiguous().view(-1, per_matrix)


def _reduce(
    x: torch.Tensor,
    squares: bool,
    out: torch.Tensor | None,
    inverse: tuple[float, float] | None = None,
    squared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pass 1 over the chunks of every matrix of ``x``, pass 2 over their partials into
    ``out`` (fp32, one per matrix); ``inverse`` = (norm_scale, eps) for inverse norms, whose
    squares go to ``squared`` (fp32, one per matrix)."""
    if x.ndim < 2:
        raise ValueError(f"a matrix or a stack of matrices is needed, got shape {tuple(x.shape)}")
    k, per_matrix = math.prod(x.shape[:-2]), x.shape[-2] * x.shape[-1]
    if out is None:
        out = torch.empty(k, dtype=torch.float32, device=x.device)
    elif out.shape != (k,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of shape ({k},)")
    if k == 0:
        return out
    chunk, chunks = _chunking(per_matrix)
    partials = torch.empty(k * chunks, dtype=torch.float32, device=x.device)
    norm_scale, eps = inverse if inverse is not None else (1.0, 0.0)
    with on_device(x.device):
        if chunks:
            rows = _matrix_rows(x, per_matrix)
            _chunk_sums_kernel[(k * chunks,)](
                rows,
                partials,
                per_matrix,
                rows.stride(0),
                chunk,
                chunks,
                SQUARES=squares,
                BLOCK=_BLOCK,
                num_warps=_WARPS,
            )
        _matrix_totals_kernel[(k,)](
            partials,
            out,
            out if squared is None else squared,  # stored to only with INVERSE_NORM
            chunks,
            float(norm_scale),
            float(eps),
            INVERSE_NORM=inverse is not None,
            BLOCK=_TOTALS_BLOCK,
            num_warps=4,
        )
    return out


def matrix_sums_triton(
    x: torch.Tensor, squares: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 sum (of squares, with ``squares``) of each trailing matrix of ``x`` (bf16,
    fp16 or fp32), shape ``[prod(x.shape[:-2])]``, into ``out`` when given.

    Fused form of ``torch.sum(x, dim=(-2, -1), dtype=torch.float32)``: fp32 sums in
    another, fixed order, so within fp32 rounding of torch's, not bitwise. A plain sum is
    non-finite exactly when an entry is, or when the sum overflows.
    """
    return _reduce(x, squares, out)


def inverse_norms_triton(
    Y: torch.Tensor, norm_scale: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`muon_dist.kernels.torch_ns.inverse_norms` of a bf16, fp16 or fp32 stack, in
    fp32, and their squares (bitwise ``inverse.square()``), in two launches.

    The sum of squares runs in another order than ``torch.linalg.vector_norm``'s, and the
    scale and ``eps`` may be applied with one rounding (a fused multiply-add) instead of two:
    within fp32 rounding of torch's result, not bitwise equal to it.
    """
    squared = torch.empty(math.prod(Y.shape[:-2]), dtype=torch.float32, device=Y.device)
    return _reduce(Y, True, None, (norm_scale, eps), squared), squared


# Programs per tensor of the many-tensor norms, each summing every _PARTS-th block.
_PARTS = 32
_NORM_BLOCK = 1024
# The dtypes the Triton passes read and write (here and in triton_elementwise.py).
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _square_parts_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    table_ptr,
    parts_ptr,
    X: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``parts[t, j]`` = the float64 sum of squares of blocks j, j + PARTS, ... of the
    tensor in row i of ``table`` (its address, its number of elements, t)."""
    row = table_ptr + tl.program_id(0) * 3
    x_ptr = tl.load(row).to(tl.pointer_type(X))
    numel = tl.load(row + 1)
    tensor = tl.load(row + 2)
    part = tl.program_id(1).to(tl.int64)
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(part * BLOCK, numel, PARTS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float64)
        total += x * x
    tl.store(parts_ptr + tensor * PARTS + part, tl.sum(total, axis=0))


@triton.jit
def _verdicts_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    parts_ptr,
    positions_ptr,
    limits_ptr,
    norms_ptr,
    verdicts_ptr,
    too_large,
    nonfinite,
    PARTS: tl.constexpr,
):
    """Tensor t's norm (the square root of its parts' sum, in a fixed order) into
    ``norms[t]``, and at its position p, ``verdicts[p]``: ``nonfinite`` where the norm is
    not finite, ``too_large`` where it exceeds ``limits[p]``, else 0."""
    tensor = tl.program_id(0).to(tl.int64)
    parts = tl.load(parts_ptr + tensor * PARTS + tl.arange(0, PARTS))
    norm = tl.sqrt(tl.sum(parts, axis=0))
    position = tl.load(positions_ptr + tensor)
    limit = tl.load(limits_ptr + position).to(tl.float64)
    finite = norm < float("inf")  # false for inf and NaN
    verdict = tl.where(finite, tl.where(norm > limit, too_large, 0.0), nonfinite)
    tl.store(norms_ptr + tensor, norm)
    tl.store(verdicts_ptr + position, verdict)


def norm_verdicts_triton(
    tensors: Sequence[torch.Tensor],
    positions: torch.Tensor,
    limits: torch.Tensor,
    verdicts: torch.Tensor,
    too_large: float,
    nonfinite: float,
) -> torch.Tensor:
    """The float64 norm of each contiguous fp32, bf16 or fp16 tensor, and the verdict on it
    written at its position (``positions``, int64): ``nonfinite`` where the norm is not
    finite, ``too_large`` where it exceeds the fp32 ``limits`` at that position, else 0,
    into the fp32 ``verdicts``. Two launches per dtype, whatever the number of tensors, from
    address tables (only where :func:`~muon_dist.kernels.tables.tables_allowed`).

    Fused form of ``torch._foreach_norm(tensors, 2, dtype=torch.float64)`` and the
    comparisons: the sums run in another, fixed order, so within float64 rounding of
    torch's norms, not bitwise; a verdict differs only for a norm that rounding puts on the
    other side of its limit.
    """
    device = verdicts.device
    norms = torch.empty(len(tensors), dtype=torch.float64, device=device)
    if not tensors:
        return norms
    parts = torch.empty(len(tensors), _PARTS, dtype=torch.float64, device=device)
    batches: dict[torch.dtype, list[list[int]]] = {}
    for index, t in enumerate(tensors):
        batches.setdefault(t.dtype, []).append([t.data_ptr(), t.numel(), index])
    with on_device(device):
        for dtype, rows in batches.items():
            _square_parts_kernel[(len(rows), _PARTS)](
                address_table(rows, device),
                parts,
                X=TL_DTYPES[dtype],
                PARTS=_PARTS,
                BLOCK=_NORM_BLOCK,
                num_warps=4,
            )
        _verdicts_kernel[(len(tensors),)](
            parts,
            positions,
            limits,
            norms,
            verdicts,
            float(too_large),
            float(nonfinite),
            PARTS=_PARTS,
            num_warps=1,
        )
    return norms
