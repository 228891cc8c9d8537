"""Time the fused momentum and update passes against torch's adds, by tensor size, and the
per-matrix reductions against torch's, by stack.

Two numbers per case: the GPU time of one call (triton.testing.do_bench, median) and the
wall time per call of a back-to-back loop, which is the CPU's launch cost once that is the
larger. ``FUSED_MIN_NUMEL`` in muon_dist/rules/forms.py comes from the first table. The
reductions are Newton–Schulz's inverse Frobenius norms (torch: ``vector_norm`` and three
small ops) and the optimizer's finiteness sums (torch: ``torch.sum`` to fp32) of bf16
stacks of the shapes a step orthogonalizes.

    python benchmarks/bench_elementwise.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import tables
import torch
import triton.testing

from muon_dist.kernels.torch_ns import inverse_norms
from muon_dist.kernels.triton_elementwise import decay_and_update_triton, momentum_input_triton
from muon_dist.kernels.triton_reduce import inverse_norms_triton, matrix_sums_triton
from muon_dist.rules.forms import FUSED_MIN_NUMEL
from muon_dist.rules.ops import advance_momentum

SIZES = [2**k for k in range(12, 29, 2)]
# [k, m, n] bf16 stacks: one to eight matrices of an 8B model's shapes.
STACKS = [
    (1, 1024, 4096),
    (8, 1024, 4096),
    (1, 4096, 4096),
    (4, 4096, 4096),
    (1, 4096, 14336),
    (8, 4096, 14336),
]
LOOP_CALLS = 200
ROUNDS = 5


def loop_us(fn: Callable[[], None]) -> float:
    """Wall time per call of back-to-back calls: launch-bound for small tensors."""
    samples = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(LOOP_CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / LOOP_CALLS * 1e6)
    return statistics.median(samples)


def timed(**fns: Callable[[], None]) -> dict[str, float]:
    """Per named call, after one warm-up call: ``<name>_gpu_us`` (GPU median by
    ``triton.testing.do_bench``) and ``<name>_loop_us`` (:func:`loop_us`)."""
    row: dict[str, float] = {}
    for name, fn in fns.items():
        fn()
        row[f"{name}_gpu_us"] = 1e3 * triton.testing.do_bench(fn, return_mode="median")
        row[f"{name}_loop_us"] = loop_us(fn)
    return row


def timing(row: dict, name: str, sep: str = " / ") -> str:
    """``<GPU µs><sep><loop µs>`` of the call ``name`` timed by :func:`timed`."""
    return f"{row[f'{name}_gpu_us']:.1f}{sep}{row[f'{name}_loop_us']:.1f}"


def bench_size(numel: int) -> dict:
    grad = torch.randn(numel, device="cuda")
    momentum = torch.randn(numel, device="cuda")
    out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
    param = torch.randn(numel, device="cuda")
    update = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    keep = torch.ones((), dtype=torch.bool, device="cuda")
    decay = torch.full((), 0.9999, device="cuda")
    step = torch.full((), -1e-6, device="cuda")

    def read_torch() -> None:
        advance_momentum(grad, momentum, 0.95, out=momentum)
        torch.add(grad, momentum, alpha=0.95, out=out)

    def read_fused() -> None:
        momentum_input_triton(grad, momentum, out, 0.95, 0.95, True, keep)

    def apply_torch() -> None:
        param.mul_(decay)
        param.addcmul_(update, step)

    def apply_fused() -> None:
        decay_and_update_triton(param, update, decay, step, keep)

    return {
        "numel": numel,
        **timed(
            read_torch=read_torch,
            read_fused=read_fused,
            apply_torch=apply_torch,
            apply_fused=apply_fused,
        ),
    }


def bench_stack(shape: tuple[int, int, int]) -> dict:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    sums = torch.empty(shape[0], device="cuda")

    def norms_torch() -> None:
        inverse_norms(x, 1.0, 1e-7)

    def norms_triton() -> None:
        inverse_norms_triton(x, 1.0, 1e-7)

    def sums_torch() -> None:
        torch.sum(x, dim=(-2, -1), dtype=torch.float32, out=sums)

    def sums_triton() -> None:
        matrix_sums_triton(x, out=sums)

    return {
        "shape": list(shape),
        "bytes": x.numel() * x.element_size(),
        **timed(
            norms_torch=norms_torch,
            norms_triton=norms_triton,
            sums_torch=sums_torch,
            sums_triton=sums_triton,
        ),
    }


def stack_name(row: dict) -> str:
    k, m, n = row["shape"]
    return f"{k}×{m}×{n}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args()
    rows = [bench_size(numel) for numel in SIZES]
    print(f"FUSED_MIN_NUMEL = {FUSED_MIN_NUMEL}; times in us (GPU median / back-to-back loop)")
    print(
        f"{'numel':>10} {'read torch':>15} {'read fused':>15} {'speedup':>7} "
        f"{'apply torch':>15} {'apply fused':>15} {'speedup':>7}"
    )
    for r in rows:
        cells = []
        for op in ("read", "apply"):
            torch_cell = timing(r, f"{op}_torch", "/")
            fused_cell = timing(r, f"{op}_fused", "/")
            speedup = r[f"{op}_torch_loop_us"] / r[f"{op}_fused_loop_us"]
            cells.append(f"{torch_cell:>15} {fused_cell:>15} {speedup:7.2f}")
        print(f"{r['numel']:>10} {' '.join(cells)}")
    stacks = [bench_stack(shape) for shape in STACKS]
    print("bf16 stacks; us (GPU median / back-to-back loop); GB/s torch/Triton, GPU time")
    print(
        f"{'stack':>14} {'norms torch':>15} {'norms Triton':>15} {'GB/s':>11} "
        f"{'sums torch':>15} {'sums Triton':>15} {'GB/s':>11}"
    )
    for r in stacks:
        cells = []
        for op in ("norms", "sums"):
            rates = "/".join(
                f"{r['bytes'] / r[f'{op}_{side}_gpu_us'] / 1e3:.0f}" for side in ("torch", "triton")
            )
            torch_cell = timing(r, f"{op}_torch", "/")
            triton_cell = timing(r, f"{op}_triton", "/")
            cells.append(f"{torch_cell:>15} {triton_cell:>15} {rates:>11}")
        print(f"{stack_name(r):>14} {' '.join(cells)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elementwise": rows, "reductions": stacks}, f, indent=1)
    if args.write_table:
        run = tables.run_info()
        tables.record("elementwise", [table_row(r) for r in rows], run)
        tables.record("reductions", [reduction_row(r) for r in stacks], run)


def table_row(row: dict) -> dict[str, str]:
    return {
        "elements": f"{row['numel']:,}",
        "momentum: torch µs": timing(row, "read_torch"),
        "momentum: fused µs": timing(row, "read_fused"),
        "update + decay: torch µs": timing(row, "apply_torch"),
        "update + decay: fused µs": timing(row, "apply_fused"),
    }


def reduction_row(row: dict) -> dict[str, str]:
    return {
        "stack": stack_name(row),
        "norms: torch µs": timing(row, "norms_torch"),
        "norms: Triton µs": timing(row, "norms_triton"),
        "sums: torch µs": timing(row, "sums_torch"),
        "sums: Triton µs": timing(row, "sums_triton"),
    }


if __name__ == "__main__":
    main()
