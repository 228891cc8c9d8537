"""Time Newton–Schulz on one CUDA GPU: torch vs Triton vs auto, side by side, in bf16.

For each shape: first-call time (Triton compile + autotune), median time per backend over
rounds in which the backends take turns, TFLOP/s by the standard count steps·(4m²n + 2m³)
per matrix (m = min dim, n = max dim), the Triton/torch speedup, and the error against a
float64 iteration on a few matrices of the batch for torch-bf16 and Triton-bf16. Exits 1
if Triton's error is over 1.5x torch's or any output is NaN, so it doubles as the GPU bf16
correctness gate.

    python benchmarks/bench_kernels.py [--steps 5] [--coefficients quintic] [--json out.json]
        [--cold-cache] [--write-table]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import tables
import torch
import triton.testing

from muon_dist.kernels import newton_schulz, newton_schulz_torch
from muon_dist.kernels.coefficients import Coefficients
from muon_dist.kernels.dispatch import prefer_triton

SHAPES: list[tuple[int, ...]] = [
    (1024, 4096),
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 8192),
    (128, 768, 2048),
    (128, 2048, 768),
    (32, 1536, 4096),
]
ROUNDS = 5  # timing rounds per backend; each a median of about 60 ms of calls
ERROR_SUBSET = 4  # matrices of each batch checked against float64, to save time
MAX_ERROR_RATIO = 1.5


def newton_schulz_float64(X: torch.Tensor, steps: int, coefficients: Coefficients) -> torch.Tensor:
    """The torch reference iteration run entirely in float64."""
    return newton_schulz_torch(X, steps=steps, coefficients=coefficients, dtype=torch.float64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


def first_call_seconds(fn: Callable[[], torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_shape(shape: tuple[int, ...], steps: int, coefficients: str) -> dict:
    X = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    runs = {
        backend: (lambda b=backend: newton_schulz(X, steps, coefficients, backend=b))
        for backend in ("torch", "triton", "auto")
    }
    row: dict = {"shape": list(shape), "flop": ns_flops(shape, steps)}
    row["first_call_s"] = first_call_seconds(runs["triton"])
    # Backends take turns, in a rotating order, so clock or thermal drift favours none.
    samples: dict[str, list[float]] = {backend: [] for backend in runs}
    order = list(runs)
    for round_index in range(ROUNDS):
        shift = round_index % len(order)
        for backend in order[shift:] + order[:shift]:
            ms = triton.testing.do_bench(runs[backend], warmup=10, rep=60, return_mode="median")
            samples[backend].append(ms)
    for backend, times in samples.items():
        row[f"{backend}_ms"] = statistics.median(times)
        row[f"{backend}_tflops"] = row["flop"] / row[f"{backend}_ms"] / 1e9
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    batch = math.prod(shape[:-2])
    row["auto_picks"] = "triton" if prefer_triton(shape[-2], shape[-1], batch) else "torch"

    subset = X.reshape(-1, *shape[-2:])[:ERROR_SUBSET]
    ref = newton_schulz_float64(subset, steps, coefficients)
    for backend in ("torch", "triton"):
        out = newton_schulz(subset, steps, coefficients, backend=backend)
        row[f"{backend}_nan"] = bool(out.isnan().any())
        row[f"{backend}_err"] = rel_err(out, ref)
    row["err_ratio"] = row["triton_err"] / row["torch_err"]
    row["ok"] = not row["triton_nan"] and row["err_ratio"] <= MAX_ERROR_RATIO
    return row


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':>16} {'1st s':>6} {'torch ms':>9} {'triton ms':>9} {'auto ms':>8} "
        f"{'torch TF':>8} {'triton TF':>9} {'speedup':>7} {'auto':>6} "
        f"{'torch err':>9} {'triton err':>10} {'ratio':>5} {'ok':>3}"
    )
    print(header)
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):>16} {r['first_call_s']:6.1f} "
            f"{r['torch_ms']:9.3f} {r['triton_ms']:9.3f} {r['auto_ms']:8.3f} "
            f"{r['torch_tflops']:8.0f} {r['triton_tflops']:9.0f} {r['speedup']:7.2f} "
            f"{r['auto_picks']:>6} {r['torch_err']:9.2e} {r['triton_err']:10.2e} "
            f"{r['err_ratio']:5.2f} {'yes' if r['ok'] else 'NO':>3}"
        )


def table_row(row: dict) -> dict[str, str]:
    return {
        "shape": "×".join(map(str, row["shape"])),
        "torch ms": f"{row['torch_ms']:.3f}",
        "Triton ms": f"{row['triton_ms']:.3f}",
        "auto ms": f"{row['auto_ms']:.3f}",
        "Triton/torch": f"{row['speedup']:.2f}×",
        "error ratio": f"{row['err_ratio']:.2f}",
        "1st call s": f"{row['first_call_s']:.1f}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--coefficients", default="quintic")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="compile into a fresh Triton cache, so first calls include compilation",
    )
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args()
    if args.cold_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="muon_dist_triton_cache_")
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kernels.py times CUDA kernels; run it on a machine with a GPU")

    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        rows.append(bench_shape(shape, args.steps, args.coefficients))
        print(
            f"done {shape}: {rows[-1]['torch_ms']:.3f} / {rows[-1]['triton_ms']:.3f} ms", flush=True
        )
        torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "steps": args.steps,
        "coefficients": args.coefficients,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(", ".join(f"{k}={v}" for k, v in meta.items()))
    print_table(rows)
    if args.write_table:
        tables.record("kernels", [table_row(r) for r in rows], tables.run_info())
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
