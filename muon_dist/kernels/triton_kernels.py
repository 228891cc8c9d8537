"""Triton kernels for the symmetric products of a Newton–Schulz step.

``A = X·Xᵀ`` and ``B = b·A + c·A·A`` are both symmetric, and ``A·A = A·Aᵀ`` because ``A`` is,
so one kernel computes ``out = alpha·P·Pᵀ + beta·Y`` for both: only tiles that reach on or
below the diagonal are computed (about half the FLOPs of a plain matmul) and each is also
written to its mirrored position. Importing this module imports Triton; the driver imports
it lazily.

Tiles are ``BLOCK_M`` rows by ``WIDTH·BLOCK_M`` columns: wide tiles feed Hopper's tensor
cores better, at the cost of some wasted work on the diagonal. Operands come through TMA
descriptors where the layout allows (16-byte aligned rows), through pointers otherwise, and
a persistent grid walks the tiles so launches stay few.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from muon_dist.kernels.triton_ns import interpret_mode

_INTERPRET = interpret_mode()
# Programs of a persistent launch in the CPU interpreter: a few, so each runs several tiles.
_INTERPRETER_PROGRAMS = 3
# Shared memory a config's operand pipeline may take: Hopper's 227 KiB less room for the
# epilogue's layout conversion.
_SHARED_MEMORY_BYTES = 200 * 1024


def _set_block_shapes(nargs: dict[str, Any]) -> None:
    """Give the TMA descriptors the box of the config being run (autotune pre-hook)."""
    if isinstance(nargs["p_rows"], TensorDescriptor):
        rows, depth = nargs["BLOCK_M"], nargs["BLOCK_K"]
        nargs["p_rows"].block_shape = [1, rows, depth]
        nargs["p_cols"].block_shape = [1, rows * nargs["WIDTH"], depth]


def make_config(
    block_m: int, width: int, block_k: int, warps: int, stages: int, persistent: bool
) -> triton.Config:
    """One kernel configuration; ``scripts/sweep_sym_kernel.py`` times many of them."""
    return triton.Config(
        {"BLOCK_M": block_m, "WIDTH": width, "BLOCK_K": block_k, "PERSISTENT": persistent},
        num_warps=warps,
        num_stages=stages,
        pre_hook=_set_block_shapes,
    )


def _gpu_configs() -> list[triton.Config]:
    """The winners of scripts/sweep_sym_kernel.py on an H200, few so first calls stay short.

    128×128 tiles won on 4096-row Gram matrices and stacks of 1536 (128×256 tiles leave the
    last of about two waves nearly empty there); 128×256 tiles on a persistent grid won on
    8192² matrices; 64×128 tiles on stacks of small squares.
    """
    return [
        make_config(128, 1, 64, 4, 4, persistent=False),
        make_config(128, 2, 64, 8, 3, persistent=True),
        make_config(64, 2, 64, 4, 4, persistent=False),
    ]


def _fits_shared_memory(
    configs: list[triton.Config], named_args: dict[str, Any], **_: Any
) -> list[triton.Config]:
    """Drop configs whose operand pipeline overflows shared memory for P's dtype (fp32)."""
    P = named_args["p_rows"]
    itemsize = (P.base if isinstance(P, TensorDescriptor) else P).element_size()

    def pipeline_bytes(config: triton.Config) -> int:
        rows = config.kwargs["BLOCK_M"] * (1 + config.kwargs["WIDTH"])
        return config.num_stages * rows * config.kwargs["BLOCK_K"] * itemsize

    fitting = [c for c in configs if pipeline_bytes(c) <= _SHARED_MEMORY_BYTES]
    return fitting or [min(configs, key=pipeline_bytes)]


def _interpreter_configs() -> list[triton.Config]:
    """One small config: the CPU interpreter's cost grows with block volume, and it has no timer."""
    return [make_config(16, 2, 32, 1, 1, persistent=True)]


def _bench(kernel_call: Callable[[], None], quantiles: tuple[float, ...]) -> list[float]:
    """Time autotune candidates briefly: a few ms each keeps first-call tuning short."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def _tile_coordinates(tile, WIDTH: tl.constexpr):
    """Row block and column block of the ``tile``-th tile of one matrix.

    Bands of ``WIDTH`` row blocks share column blocks: band ``p`` holds ``WIDTH·(p+1)``
    tiles, row by row, so bands ``0..p-1`` hold ``WIDTH·T(p)`` with ``T(p) = p(p+1)/2``.
    """
    pair = tile // WIDTH
    # Invert T(band) <= pair < T(band + 1); the float root can be off by one either way.
    band = ((tl.sqrt(8.0 * pair.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    band = tl.where(band * (band + 1) // 2 > pair, band - 1, band)
    band = tl.where((band + 1) * (band + 2) // 2 <= pair, band + 1, band)
    local = tile - WIDTH * (band * (band + 1) // 2)
    sub_row = local // (band + 1)
    return band * WIDTH + sub_row, local - sub_row * (band + 1)


@triton.jit
def _gram_tile(
    p_rows,
    p_cols,
    batch,
    r0,
    c0,
    M,
    K,
    stride_pb,
    stride_pm,
    stride_pk,
    USE_TMA: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``P[r0:r0+BLOCK_M]·P[c0:c0+BLOCK_N]ᵀ`` of one matrix in fp32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # TMA fills rows past M and columns past K with zeros.
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = p_rows.load([batch, r0, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
            b = p_cols.load([batch, c0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    else:
        base = p_rows + batch.to(tl.int64) * stride_pb  # batch·m·k can exceed 2**31
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past M are clamped to valid rows for the loads and masked out at the store.
        rows_a = ((r0 + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
        rows_b = ((c0 + tl.arange(0, BLOCK_N)) % M).to(tl.int64)
        a_ptrs = base + rows_a[:, None] * stride_pm + offs_k[None, :] * stride_pk
        b_ptrs = base + rows_b[:, None] * stride_pm + offs_k[None, :] * stride_pk
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
            b_ptrs += BLOCK_K * stride_pk
    return acc


@triton.autotune(
    configs=_interpreter_configs() if _INTERPRET else _gpu_configs(),
    key=["M", "K", "batch_class", "HAS_Y", "USE_TMA"],
    prune_configs_by={"early_config_prune": _fits_shared_memory},
    do_bench=_bench,
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["batch_class"])
def _sym_product_kernel(
    p_rows,  # TMA descriptor with BLOCK_M-row boxes, or P's pointer
    p_cols,  # TMA descriptor with BLOCK_N-row boxes, or P's pointer
    y_ptr,
    out_ptr,
    batch_count,
    M,
    K,
    batch_class,  # autotune key only: the best tile size depends on how many programs run
    stride_pb,
    stride_pm,
    stride_pk,
    stride_yb,
    stride_ym,
    stride_yn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    HAS_Y: tl.constexpr,
    USE_TMA: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,  # read by the grid: one program per SM instead of per tile
):
    """``out[b] = alpha·P[b]·P[b]ᵀ (+ beta·Y[b])``, each program walking tiles in turn."""
    BLOCK_N: tl.constexpr = BLOCK_M * WIDTH
    bands = tl.cdiv(M, BLOCK_N)
    tiles_per_matrix = WIDTH * (bands * (bands + 1) // 2)
    for t in range(tl.program_id(0), batch_count * tiles_per_matrix, tl.num_programs(0)):
        batch = t // tiles_per_matrix
        row_block, col_block = _tile_coordinates(t - batch * tiles_per_matrix, WIDTH)
        r0 = row_block * BLOCK_M
        c0 = col_block * BLOCK_N
        # The last band can hold row blocks wholly past M when BLOCK_N does not divide it.
        if r0 < M:
            acc = _gram_tile(
                p_rows,
                p_cols,
                batch,
                r0,
                c0,
                M,
                K,
                stride_pb,
                stride_pm,
                stride_pk,
                USE_TMA,
                INPUT_PRECISION,
                EVEN_K,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            rows = r0 + tl.arange(0, BLOCK_M)
            cols = c0 + tl.arange(0, BLOCK_N)
            rows64 = rows.to(tl.int64)
            cols64 = cols.to(tl.int64)
            batch64 = batch.to(tl.int64)
            in_bounds = (rows[:, None] < M) & (cols[None, :] < M)
            # Each element is stored once: on or below the diagonal here, above it mirrored.
            lower = in_bounds & (cols[None, :] <= rows[:, None])
            result = acc * alpha
            if HAS_Y:
                y_ptrs = y_ptr + batch64 * stride_yb + rows64[:, None] * stride_ym
                y = tl.load(y_ptrs + cols64[None, :] * stride_yn, mask=lower, other=0.0)
                result += beta * y.to(tl.float32)
            result = result.to(out_ptr.dtype.element_ty)
            o_base = out_ptr + batch64 * stride_ob
            tl.store(
                o_base + rows64[:, None] * stride_om + cols64[None, :] * stride_on,
                result,
                mask=lower,
            )
            above = (cols[:, None] < rows[None, :]) & (rows[None, :] < M) & (cols[:, None] < M)
            tl.store(
                o_base + cols64[:, None] * stride_om + rows64[None, :] * stride_on,
                tl.trans(result),
                mask=above,
            )


def _batch_class(batch: int) -> int:
    """Bucket the batch (1, 2, 4, ..., 64) so stacks of similar size share a tuning result."""
    return min(1 << max(batch - 1, 0).bit_length(), 64)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _program_limit(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _multiprocessors(device.index if device.index is not None else 0)


def _tma_compatible(P: torch.Tensor) -> bool:
    """TMA needs a non-empty tensor, a contiguous last dim and 16-byte aligned base and strides."""
    size = P.element_size()
    return (
        P.numel() > 0
        and P.stride(-1) == 1
        and P.data_ptr() % 16 == 0
        and all((stride * size) % 16 == 0 for stride in P.stride()[:-1])
    )


def launch_sym_product(
    kernel: Any,
    P: torch.Tensor,
    out: torch.Tensor,
    alpha: float,
    Y: torch.Tensor | None,
    beta: float,
    use_tma: bool | None = None,
) -> None:
    """Launch ``kernel`` (the autotuned one, or a single-config copy when sweeping).

    ``use_tma`` None loads through TMA wherever the layout allows; False forces pointers.
    """
    batch, m, k = P.shape
    if use_tma is None:
        use_tma = _tma_compatible(P)
    elif use_tma and not _tma_compatible(P):
        raise ValueError(
            f"use_tma=True needs 16-byte aligned rows, got shape {tuple(P.shape)} with "
            f"strides {P.stride()} in {P.dtype}; pass use_tma=None to pick automatically"
        )
    if use_tma:
        # Block shapes are placeholders; the config's pre-hook sets them before the launch.
        p_rows = TensorDescriptor(P, list(P.shape), list(P.stride()), [1, 16, 16])
        p_cols = TensorDescriptor(P, list(P.shape), list(P.stride()), [1, 16, 16])
    else:
        p_rows = p_cols = P
    programs = _program_limit(P.device)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        bands = triton.cdiv(m, meta["BLOCK_M"] * meta["WIDTH"])
        tiles = batch * meta["WIDTH"] * bands * (bands + 1) // 2
        return (min(tiles, programs) if meta["PERSISTENT"] else tiles,)

    kernel[grid](
        p_rows,
        p_cols,
        Y,
        out,
        batch,
        m,
        k,
        _batch_class(batch),
        *P.stride(),
        *(Y.stride() if Y is not None else (0, 0, 0)),
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_Y=Y is not None,
        USE_TMA=use_tma,
        INPUT_PRECISION="ieee" if P.dtype == torch.float32 else "tf32",
    )


def sym_product(
    P: torch.Tensor,
    out: torch.Tensor,
    alpha: float = 1.0,
    Y: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Write ``alpha·P·Pᵀ + beta·Y`` for a batch ``P`` of shape [batch, m, k] into ``out``.

    ``out`` is [batch, m, m] in any floating dtype; ``Y`` (same shape as ``out``) must be
    symmetric, since only its lower-triangular part is read. Accumulates in fp32; fp32
    operands use exact ("ieee") products rather than TF32 so the CPU tests are meaningful.
    """
    batch, m, _ = P.shape
    if out.shape != (batch, m, m):
        raise ValueError(f"out must have shape {(batch, m, m)}, got {tuple(out.shape)}")
    if Y is not None and Y.shape != out.shape:
        raise ValueError(f"Y must have shape {tuple(out.shape)}, got {tuple(Y.shape)}")
    if batch == 0 or m == 0:
        return out
    launch_sym_product(_sym_product_kernel, P, out, alpha, Y, beta)
    return out
