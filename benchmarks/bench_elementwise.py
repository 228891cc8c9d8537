"""Time the fused momentum and update passes against torch's adds, by tensor size.

Two numbers per size: the GPU time of one call (triton.testing.do_bench, median) and the
wall time per call of a back-to-back loop, which is the CPU's launch cost once that is the
larger. ``FUSED_MIN_NUMEL`` in muon_dist/rules/forms.py comes from this table.

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

from muon_dist.kernels.triton_elementwise import decay_and_update_triton, momentum_input_triton
from muon_dist.rules.forms import FUSED_MIN_NUMEL
from muon_dist.rules.ops import advance_momentum

SIZES = [2**k for k in range(12, 29, 2)]
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

    row: dict = {"numel": numel}
    for name, fn in (
        ("read_torch", read_torch),
        ("read_fused", read_fused),
        ("apply_torch", apply_torch),
        ("apply_fused", apply_fused),
    ):
        fn()
        row[f"{name}_gpu_us"] = 1e3 * triton.testing.do_bench(fn, return_mode="median")
        row[f"{name}_loop_us"] = loop_us(fn)
    return row


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
            torch_cell = f"{r[f'{op}_torch_gpu_us']:.1f}/{r[f'{op}_torch_loop_us']:.1f}"
            fused_cell = f"{r[f'{op}_fused_gpu_us']:.1f}/{r[f'{op}_fused_loop_us']:.1f}"
            speedup = r[f"{op}_torch_loop_us"] / r[f"{op}_fused_loop_us"]
            cells.append(f"{torch_cell:>15} {fused_cell:>15} {speedup:7.2f}")
        print(f"{r['numel']:>10} {' '.join(cells)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.write_table:
        tables.record("elementwise", [table_row(r) for r in rows], tables.run_info())


def table_row(row: dict) -> dict[str, str]:
    def cell(name: str) -> str:
        return f"{row[f'{name}_gpu_us']:.1f} / {row[f'{name}_loop_us']:.1f}"

    return {
        "elements": f"{row['numel']:,}",
        "momentum: torch µs": cell("read_torch"),
        "momentum: fused µs": cell("read_fused"),
        "update + decay: torch µs": cell("apply_torch"),
        "update + decay: fused µs": cell("apply_fused"),
    }


if __name__ == "__main__":
    main()
