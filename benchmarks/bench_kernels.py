"""Time Newton–Schulz on one CUDA GPU: standard and Gram iterations on torch and Triton, in bf16.

For each shape: first-call time (Triton compile + autotune), median time of each variant
(torch, triton: the standard iteration; gram_torch, gram_triton: the Gram iteration; auto:
what ``newton_schulz`` picks) over rounds in which the variants take turns, TFLOP/s by the
standard count steps·(4m²n + 2m³) per matrix (m = min dim, n = max dim), and the error
against a float64 standard iteration on a few matrices of the batch. Exits 1 if a Triton
or Gram variant's error is over 1.5x the torch bf16 standard's or any output is NaN, so it
doubles as the GPU bf16 correctness gate.

``--graphs`` times every variant as replays of a CUDA graph captured from it (each call's
launches cost the host nothing, as in a captured optimizer step or a replayed stack), where
the default times calls launched one by one; its rows are printed and kept by ``--json``,
not written to the kernels table, whose rows are launched calls.

    python benchmarks/bench_kernels.py [--steps 5] [--coefficients quintic] [--json out.json]
        [--cold-cache] [--write-table] [--shapes 1024x4096,32x1536x4096] [--gram-restarts 3]
        [--graphs]
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
from muon_dist.kernels.dispatch import auto_uses_triton, prefer_gram, replays_from_graph
from muon_dist.kernels.gram import DEFAULT_RESTARTS
from muon_dist.kernels.graphs import GraphCache, capturing
from muon_dist.kernels.streams import side_stream

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


def first_call_seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# Variant name -> (backend, method) of newton_schulz.
VARIANTS = {
    "torch": ("torch", "standard"),
    "triton": ("triton", "standard"),
    "gram_torch": ("torch", "gram"),
    "gram_triton": ("triton", "gram"),
    "auto": ("auto", "auto"),
}
CHECKED = ("torch", "triton", "gram_torch", "gram_triton")


def replayed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after warm-up calls on a side stream, which compile
    and tune its kernels): the returned call replays it."""
    side = side_stream(torch.device("cuda"), "bench_kernels warm-up")  # one for every call
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        fn()
    return graph.replay


def bench_shape(
    shape: tuple[int, ...],
    steps: int,
    coefficients: str,
    restarts: tuple[int, ...],
    in_graphs: bool = False,
) -> dict:
    X = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    graphs = GraphCache()  # "auto" replays from graphs as the optimizer's step does

    def variant(backend: str, method: str) -> Callable[[], torch.Tensor]:
        return lambda: newton_schulz(
            X,
            steps,
            coefficients,
            backend=backend,
            method=method,
            gram_restarts=restarts,
            graphs=None if in_graphs else graphs,
            captured=in_graphs,
        )

    runs: dict[str, Callable[[], object]] = {
        name: variant(*spec) for name, spec in VARIANTS.items()
    }
    row: dict = {"shape": list(shape), "flop": ns_flops(shape, steps)}
    row["first_call_s"] = first_call_seconds(runs["triton"]) + first_call_seconds(
        runs["gram_triton"]
    )
    if in_graphs:
        runs = {name: replayed(run) for name, run in runs.items()}
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
    gram = prefer_gram(shape[-2], shape[-1])
    backend = "triton" if auto_uses_triton(X, X.dtype, from_graph=True) else "torch"
    graphed = "+graph" if replays_from_graph(X) else ""
    row["auto_picks"] = f"{'gram' if gram else 'std'}/{backend}{graphed}"

    subset = X.reshape(-1, *shape[-2:])[:ERROR_SUBSET]
    ref = newton_schulz_float64(subset, steps, coefficients)
    for name in CHECKED:
        backend, method = VARIANTS[name]
        out = newton_schulz(
            subset, steps, coefficients, backend=backend, method=method, gram_restarts=restarts
        )
        row[f"{name}_nan"] = bool(out.isnan().any())
        row[f"{name}_err"] = rel_err(out, ref)
    row["err_ratio"] = max(row[f"{name}_err"] for name in CHECKED) / row["torch_err"]
    row["ok"] = not any(row[f"{name}_nan"] for name in CHECKED) and (
        row["err_ratio"] <= MAX_ERROR_RATIO
    )
    return row


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':>16} {'1st s':>6} {'torch ms':>9} {'triton ms':>9} {'gram-t ms':>9} "
        f"{'gram-tr ms':>10} {'auto ms':>8} {'auto':>17} {'torch err':>9} {'triton err':>10} "
        f"{'gram-t err':>10} {'gram-tr err':>11} {'ratio':>5} {'ok':>3}"
    )
    print(header)
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):>16} {r['first_call_s']:6.1f} "
            f"{r['torch_ms']:9.3f} {r['triton_ms']:9.3f} {r['gram_torch_ms']:9.3f} "
            f"{r['gram_triton_ms']:10.3f} {r['auto_ms']:8.3f} {r['auto_picks']:>17} "
            f"{r['torch_err']:9.2e} {r['triton_err']:10.2e} {r['gram_torch_err']:10.2e} "
            f"{r['gram_triton_err']:11.2e} {r['err_ratio']:5.2f} {'yes' if r['ok'] else 'NO':>3}"
        )


def table_row(row: dict) -> dict[str, str]:
    return {
        "shape": "×".join(map(str, row["shape"])),
        "torch ms": f"{row['torch_ms']:.3f}",
        "Triton ms": f"{row['triton_ms']:.3f}",
        "Gram torch ms": f"{row['gram_torch_ms']:.3f}",
        "Gram Triton ms": f"{row['gram_triton_ms']:.3f}",
        "auto ms": f"{row['auto_ms']:.3f}",
        "auto runs": row["auto_picks"],
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
    parser.add_argument(
        "--shapes", help="comma-separated shapes such as 1024x4096,32x1536x4096 (default: all)"
    )
    parser.add_argument(
        "--gram-restarts",
        default=",".join(map(str, DEFAULT_RESTARTS)),
        help="steps before which the Gram iteration restarts, comma-separated ('' for none)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="time each variant as replays of a CUDA graph captured from it",
    )
    args = parser.parse_args()
    if args.graphs and args.write_table:
        parser.error(
            "--graphs with --write-table: the kernels table holds calls launched one by one; "
            "keep graph replays with --json PATH instead"
        )
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    restarts = tuple(int(k) for k in args.gram_restarts.split(",") if k)
    if args.cold_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="muon_dist_triton_cache_")
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kernels.py times CUDA kernels; run it on a machine with a GPU")

    torch.manual_seed(0)
    rows = []
    for shape in shapes:
        rows.append(bench_shape(shape, args.steps, args.coefficients, restarts, args.graphs))
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
        "gram_restarts": restarts,
        "timed": "graph replays" if args.graphs else "launched calls",
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
