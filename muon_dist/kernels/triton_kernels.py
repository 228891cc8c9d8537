"""Triton kernels for the symmetric products of a Newton–Schulz step.

``A = X·Xᵀ`` and ``B = b·A + c·A·A`` are both symmetric, and ``A·A = A·Aᵀ`` because ``A`` is,
so one kernel computes ``out = s·(alpha·P·Pᵀ + beta·Y + d·I)`` for both: only the tiles on or
below the diagonal are computed (about half the FLOPs of a plain matmul) and each is also
written to its mirrored position. The per-matrix scale ``s`` and the diagonal ``d`` let the
step's normalisation and its ``a·I`` term ride in the epilogue instead of separate passes.
Importing this module imports Triton; the driver imports it lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import interpret_mode

_INTERPRET = interpret_mode()


# (BLOCK_M, BLOCK_K, warps, stages) of the autotuned configs on a GPU. A short list, so the
# first call on a new shape compiles and times only a few kernels. Square 128 tiles feed the
# Hopper tensor cores best on large Gram matrices; 64 tiles keep enough programs in flight
# when there are few 128 tiles (one 1024-row matrix has only 36).
GPU_TILES: tuple[tuple[int, int, int, int], ...] = (
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
)


def tile_config(tile: tuple[int, int, int, int]) -> triton.Config:
    """The autotuner config for a (BLOCK_M, BLOCK_K, warps, stages) tile."""
    block_m, block_k, warps, stages = tile
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages
    )


def _interpreter_configs() -> list[triton.Config]:
    """One small config: the CPU interpreter's cost grows with block volume, and it has no timer."""
    return [tile_config((32, 32, 1, 1))]


def _bench(kernel_call: Callable[[], None], quantiles: tuple[float, ...]) -> list[float]:
    """Time autotune candidates briefly: a few ms each keeps first-call tuning short."""
    times: list[float] = triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
    return times


@triton.autotune(
    configs=_interpreter_configs() if _INTERPRET else [tile_config(t) for t in GPU_TILES],
    key=["M", "K", "batch_class", "HAS_Y", "K_CONTIGUOUS"],
    do_bench=_bench,
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["batch_class"])
def _sym_product_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    p_ptr,
    q_ptr,
    y_ptr,
    out_ptr,
    scale_ptr,
    M,
    K,
    batch_class,  # autotune key only: the best tile size depends on how many programs run
    stride_pb,
    stride_pm,
    stride_pk,
    stride_qb,
    stride_qm,
    stride_qk,
    stride_yb,
    stride_ym,
    stride_yn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    diag,
    HAS_Y: tl.constexpr,
    K_CONTIGUOUS: tl.constexpr,  # autotune key only: a transposed P loads differently
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[b] = s[b]·(alpha·P[b]·Q[b]ᵀ + beta·Y[b] + diag·I)`` for one lower-triangular tile
    of one matrix (the Y term only with HAS_Y; Q is P itself unless the caller passes a
    second operand whose product with P is known to be symmetric). The scale and the
    diagonal are always applied, with 1 and 0 when unused: two flags more would double the
    variants that a new shape compiles on its first call, for a few epilogue instructions
    per tile."""
    pid = tl.program_id(0)
    tiles_per_side = tl.cdiv(M, BLOCK_M)
    tiles_per_matrix = tiles_per_side * (tiles_per_side + 1) // 2
    batch = pid // tiles_per_matrix
    tile = pid - batch * tiles_per_matrix
    # Invert tile = row·(row+1)/2 + col (col <= row); the float root can be off by one.
    row = ((tl.sqrt(8.0 * tile.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    row = tl.where(row * (row + 1) // 2 > tile, row - 1, row)
    row = tl.where((row + 1) * (row + 2) // 2 <= tile, row + 1, row)
    col = tile - row * (row + 1) // 2

    batch = batch.to(tl.int64)  # batch·m·n can exceed 2**31
    p_base = p_ptr + batch * stride_pb
    q_base = q_ptr + batch * stride_qb
    offs_r = row * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = col * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M are clamped to valid rows for the loads and masked out at the store.
    rows_r = (offs_r % M).to(tl.int64)
    rows_c = (offs_c % M).to(tl.int64)
    a_ptrs = p_base + rows_r[:, None] * stride_pm + offs_k[None, :] * stride_pk
    b_ptrs = q_base + rows_c[:, None] * stride_qm + offs_k[None, :] * stride_qk

    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask, other=0.0)
            b = tl.load(b_ptrs, mask=k_mask, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_pk
        b_ptrs += BLOCK_K * stride_qk

    result = acc * alpha
    out_r = offs_r.to(tl.int64)
    out_c = offs_c.to(tl.int64)
    mask = (offs_r[:, None] < M) & (offs_c[None, :] < M)
    if HAS_Y:
        y_ptrs = y_ptr + batch * stride_yb + out_r[:, None] * stride_ym + out_c[None, :] * stride_yn
        result += beta * tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    result = tl.where(offs_r[:, None] == offs_c[None, :], result + diag, result)
    result *= tl.load(scale_ptr + batch)
    result = result.to(out_ptr.dtype.element_ty)

    # Diagonal tiles take their upper triangle from their lower one, so the output is exactly
    # symmetric even where P·Qᵀ is symmetric only up to rounding (the Gram iteration relies
    # on it). Other tiles store with plain bounds masks, which keep the stores vectorised.
    if row == col:
        result = tl.where(offs_r[:, None] >= offs_c[None, :], result, tl.trans(result))
    o_base = out_ptr + batch * stride_ob
    tl.store(o_base + out_r[:, None] * stride_om + out_c[None, :] * stride_on, result, mask=mask)
    if row != col:
        mirror_ptrs = o_base + out_c[:, None] * stride_om + out_r[None, :] * stride_on
        tl.store(mirror_ptrs, tl.trans(result), mask=tl.trans(mask))


@functools.cache
def _unit_scales(batch: int, device: torch.device) -> torch.Tensor:
    """Scales of 1 for products without one, kept per batch size and device."""
    return torch.ones(batch, dtype=torch.float32, device=device)


def _batch_class(batch: int) -> int:
    """Bucket the batch (1, 2, 4, ..., 64) so stacks of similar size share a tuning result."""
    return min(1 << max(batch - 1, 0).bit_length(), 64)


def sym_product(
    P: torch.Tensor,
    out: torch.Tensor,
    alpha: float = 1.0,
    Y: torch.Tensor | None = None,
    beta: float = 0.0,
    diag: float = 0.0,
    scale: torch.Tensor | None = None,
    Q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``scale·(alpha·P·Qᵀ + beta·Y + diag·I)`` for a batch ``P`` of shape [batch, m, k]
    into ``out``; ``Q`` defaults to ``P``.

    ``out`` is [batch, m, m] in any floating dtype; ``Y`` (same shape as ``out``) must be
    symmetric, since only its lower-triangular tiles are read; ``scale`` holds one fp32
    factor per matrix (``batch`` elements, any shape). A separate ``Q`` (shape of ``P``) is
    for products known to be symmetric, such as two commuting symmetric matrices in the Gram
    iteration: the upper triangle is the mirror of the lower one, so a product that is not
    symmetric comes out wrong. Accumulates in fp32 and rounds once;
    fp32 operands use exact ("ieee") products rather than TF32 so the CPU tests are
    meaningful.
    """
    batch, m, k = P.shape
    if out.shape != (batch, m, m):
        raise ValueError(f"out must have shape {(batch, m, m)}, got {tuple(out.shape)}")
    if Q is not None and Q.shape != P.shape:
        raise ValueError(f"Q must have shape {tuple(P.shape)}, got {tuple(Q.shape)}")
    if Y is not None and Y.shape != out.shape:
        raise ValueError(f"Y must have shape {tuple(out.shape)}, got {tuple(Y.shape)}")
    if batch == 0 or m == 0:
        return out
    if scale is not None and (scale.numel() != batch or scale.dtype != torch.float32):
        raise ValueError(
            f"scale must hold {batch} float32 factors, one per matrix; got "
            f"{scale.numel()} of {scale.dtype}"
        )
    y_strides = Y.stride() if Y is not None else (0, 0, 0)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        side = triton.cdiv(m, meta["BLOCK_M"])
        return (batch * side * (side + 1) // 2,)

    Q = P if Q is None else Q
    _sym_product_kernel[grid](
        P,
        Q,
        Y,
        out,
        scale.contiguous() if scale is not None else _unit_scales(batch, P.device),
        m,
        k,
        _batch_class(batch),
        *P.stride(),
        *Q.stride(),
        *y_strides,
        *out.stride(),
        float(alpha),
        float(beta),
        float(diag),
        HAS_Y=Y is not None,
        K_CONTIGUOUS=P.stride(2) == 1,
        INPUT_PRECISION="ieee" if P.dtype == torch.float32 else "tf32",
    )
    return out
