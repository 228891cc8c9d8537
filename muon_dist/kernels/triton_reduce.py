"""Per-matrix sums and sums of squares of a stack in Triton, in a fixed order on many programs.

Torch reduces each matrix with few programs, which leaves most of a GPU idle for a stack of
one to eight large matrices. Here every matrix is cut into chunks that depend on its size
alone, one program each (pass 1 writes their fp32 partials); a second, tiny pass sums each
matrix's partials. No atomics: the same input gives the same bits on every run, and a
matrix is cut the same way in any stack. Importing this module imports Triton; the
Newton–Schulz driver and :mod:`muon_dist.rules.ops` import it lazily.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import on_device

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
    chunks,
    norm_scale,
    eps,
    INVERSE_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[i]`` = the sum of matrix i's ``chunks`` partials, in a fixed order; with
    INVERSE_NORM, ``1 / (norm_scale·√sum + eps)`` (IEEE square root and division)."""
    matrix = tl.program_id(0).to(tl.int64)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, chunks, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += tl.load(partials_ptr + matrix * chunks + offsets, mask=offsets < chunks, other=0.0)
    value = tl.sum(total, axis=0)
    if INVERSE_NORM:
        value = tl.div_rn(1.0, tl.sqrt_rn(value) * norm_scale + eps)
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
) -> torch.Tensor:
    """Pass 1 over the chunks of every matrix of ``x``, pass 2 over their partials into
    ``out`` (fp32, one per matrix); ``inverse`` = (norm_scale, eps) for inverse norms."""
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


def inverse_norms_triton(Y: torch.Tensor, norm_scale: float, eps: float) -> torch.Tensor:
    """:func:`muon_dist.kernels.torch_ns.inverse_norms` of a bf16, fp16 or fp32 stack, in
    fp32, in two launches.

    The sum of squares runs in another order than ``torch.linalg.vector_norm``'s, and the
    scale and ``eps`` may be applied with one rounding (a fused multiply-add) instead of two:
    within fp32 rounding of torch's result, not bitwise equal to it.
    """
    return _reduce(Y, True, None, (norm_scale, eps))
