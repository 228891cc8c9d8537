"""Time every candidate config of the symmetric Triton kernel against torch, per shape.

This is how the autotune list in ``muon_dist/kernels/triton_kernels.py`` was chosen; rerun
it on a new GPU before changing that list. For each Newton–Schulz shape it times both
symmetric products, ``X·Xᵀ`` and ``c·A·A + b·A``, with each config alone (no autotuning),
loading through TMA and through pointers, next to the cuBLAS call the torch backend makes,
and prints the best config per product.

    python scripts/sweep_sym_kernel.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

from muon_dist.kernels import triton_kernels
from muon_dist.kernels.triton_kernels import launch_sym_product, make_config

# (batch, m, n) with m <= n: the Gram side of the bench_kernels.py and bench_step.py shapes.
SHAPES = [
    (1, 1024, 4096),
    (1, 2048, 4096),
    (1, 4096, 4096),
    (1, 4096, 14336),
    (1, 8192, 8192),
    (128, 768, 2048),
    (32, 1536, 4096),
    (8, 512, 2048),
]

# (BLOCK_M, WIDTH, BLOCK_K, warps, stages, persistent); each runs with TMA and with pointers.
CANDIDATES = [
    (128, 2, 64, 8, 3, True),
    (128, 2, 64, 8, 3, False),
    (128, 1, 64, 8, 4, True),
    (128, 1, 64, 8, 4, False),
    (128, 1, 64, 8, 3, False),
    (128, 1, 64, 4, 4, False),
    (128, 1, 64, 4, 3, False),
    (128, 1, 64, 4, 3, True),
    (64, 2, 64, 4, 4, False),
]
VARIANTS = [(c, tma) for c in CANDIDATES for tma in (True, False)]


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep_product(P: torch.Tensor, Y: torch.Tensor | None, coeffs: tuple[float, float]) -> dict:
    """Time ``alpha·P·Pᵀ (+ beta·Y)`` for torch and every candidate; check each result."""
    batch, m, k = P.shape
    alpha, beta = coeffs
    out = torch.empty(batch, m, m, dtype=P.dtype, device=P.device)
    if Y is None:
        ref = torch.bmm(P, P.mT)
        torch_ms = median_ms(lambda: torch.bmm(P, P.mT, out=out))
    else:
        ref = torch.baddbmm(Y, P, P, beta=beta, alpha=alpha)
        torch_ms = median_ms(lambda: torch.baddbmm(Y, P, P, beta=beta, alpha=alpha, out=out))
    row: dict = {"shape": [batch, m, k], "product": "gram" if Y is None else "poly"}
    row["flop"] = 2.0 * batch * m * m * k
    row["torch_ms"] = torch_ms
    timings = {}
    for candidate, tma in VARIANTS:
        kernel = triton.autotune(configs=[make_config(*candidate)], key=[])(
            triton_kernels._sym_product_kernel.fn
        )

        def run(kernel: object = kernel, tma: bool = tma) -> None:
            launch_sym_product(kernel, P, out, alpha, Y, beta, use_tma=tma)

        name = f"{candidate} {'tma' if tma else 'ptr'}"
        try:
            run()
        except OutOfResources as error:
            timings[name] = {"error": str(error)}
            continue
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        timings[name] = {"ms": median_ms(run), "err": err}
    row["candidates"] = timings
    best = min(
        (c for c in timings.items() if "ms" in c[1] and c[1]["err"] < 2e-2),
        key=lambda c: c[1]["ms"],
    )
    row["best"], row["best_ms"] = best[0], best[1]["ms"]
    row["speedup"] = torch_ms / best[1]["ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every timing here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise RuntimeError("sweep_sym_kernel.py times CUDA kernels; run it on a GPU machine")
    torch.manual_seed(0)
    rows = []
    for batch, m, n in SHAPES:
        X = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16) / n**0.5
        A = torch.bmm(X, X.mT)
        rows.append(sweep_product(X, None, (1.0, 0.0)))
        rows.append(sweep_product(A, A, (2.03, -4.78)))
        for r in rows[-2:]:
            print(f"done {r['shape']} {r['product']}: best {r['best']}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    names = [f"{c} {'tma' if tma else 'ptr'}" for c, tma in VARIANTS]
    print("per-config ms (rows: shape/product; columns: VARIANTS in order)")
    for r in rows:
        cells = " ".join(f"{r['candidates'][n].get('ms', float('nan')):7.3f}" for n in names)
        shape = "x".join(map(str, r["shape"]))
        print(f"{shape:>14} {r['product']:4} torch {r['torch_ms']:7.3f} | {cells}")
    print(f"{'shape':>14} prod {'torch ms':>8} {'best ms':>8} speedup TF(std)  best")
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):>14} {r['product']:4} {r['torch_ms']:8.3f} "
            f"{r['best_ms']:8.3f} {r['speedup']:7.2f} {r['flop'] / r['best_ms'] / 1e9:7.0f}  "
            f"{r['best']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
