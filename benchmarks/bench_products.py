"""Time the two symmetric products of a Newton–Schulz step: Triton against cuBLAS, per stack.

    python benchmarks/bench_products.py [--sweep] [--write-table]

For each stack: the Gram product ``X·Xᵀ`` (cuBLAS ``bmm``) and ``b·A + c·A·A`` (cuBLAS
``baddbmm``, which copies ``A`` into its output first) against ``sym_product`` with its
autotuned config. ``--sweep`` also times each config of ``CANDIDATES`` alone, by handing the
autotuner that one config, to tell whether the kept list misses a better one. bf16, one GPU;
µs are medians of ``triton.testing.do_bench``; "TF" is TFLOP/s by the standard count
(``2·b·m²·k`` and ``2·b·m³``), the same count for both, so the symmetric kernel's halved work
shows as a rate above the hardware's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import tables
import torch
import triton.testing

from muon_dist.kernels import triton_kernels

STACKS = [
    (32, 768, 2048),
    (128, 768, 2048),
    (32, 1536, 4096),
    (4, 1024, 4096),
    (1, 4096, 4096),
    (1, 8192, 8192),
]
# (BLOCK_M, BLOCK_K, warps, stages): the kept list and some tiles it does not hold.
CANDIDATES = [
    *triton_kernels.GPU_TILES,
    (128, 128, 8, 3),
    (128, 32, 4, 4),
    (64, 64, 4, 3),
    (64, 32, 4, 5),
    (128, 64, 4, 4),
]


@contextmanager
def only_config(candidate: tuple[int, int, int, int]) -> Iterator[None]:
    """Let the autotuner run one config: with a single candidate it benchmarks nothing."""
    kernel = triton_kernels._sym_product_kernel
    kept = kernel.configs
    kernel.configs = [triton_kernels.tile_config(candidate)]
    try:
        yield
    finally:
        kernel.configs = kept


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def report(
    label: str, flop: float, runs: dict[str, Callable[[], object]], sweep: bool
) -> dict[str, float]:
    """Print one product's times, fastest first, and return them (µs by name); ``runs`` holds
    "cublas" and "triton"."""
    times = {name: time_us(fn) for name, fn in runs.items()}
    if sweep:
        for candidate in CANDIDATES:
            with only_config(candidate):
                times[str(candidate)] = time_us(runs["triton"])
    ranked = sorted(times.items(), key=lambda item: item[1])
    cells = ", ".join(f"{name} {us:.0f} µs ({flop / us / 1e6:.0f} TF)" for name, us in ranked)
    print(f"{label}: {cells}", flush=True)
    return times


def bench_stack(batch: int, m: int, k: int, sweep: bool) -> dict[str, str]:
    """Time both products of one stack; return its row of the products table."""
    P = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    A = torch.bmm(P, P.mT)
    out = torch.empty_like(A)
    gram = report(
        f"{batch}x{m}x{k} gram",
        2.0 * batch * m * m * k,
        {
            "cublas": lambda: torch.bmm(P, P.mT, out=out),
            "triton": lambda: triton_kernels.sym_product(P, out=out),
        },
        sweep,
    )
    poly = report(
        f"{batch}x{m}x{k} poly",
        2.0 * batch * m**3,
        {
            "cublas": lambda: torch.baddbmm(A, A, A, beta=-4.7, alpha=2.0),
            "triton": lambda: triton_kernels.sym_product(
                A, out=out, alpha=2.0, Y=A, beta=-4.7, diag=3.4
            ),
        },
        sweep,
    )
    return {
        "stack": "×".join(map(str, (batch, m, k) if batch > 1 else (m, k))),
        "X·Xᵀ: cuBLAS µs": f"{gram['cublas']:.0f}",
        "X·Xᵀ: Triton µs": f"{gram['triton']:.0f}",
        "b·A + c·A·A: cuBLAS µs": f"{poly['cublas']:.0f}",
        "b·A + c·A·A: Triton µs": f"{poly['triton']:.0f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time each candidate config")
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise RuntimeError("bench_products.py times CUDA kernels; run it on a GPU machine")
    rows = [bench_stack(batch, m, k, args.sweep) for batch, m, k in STACKS]
    if args.write_table:
        tables.record("products", rows, tables.run_info())


if __name__ == "__main__":
    main()
