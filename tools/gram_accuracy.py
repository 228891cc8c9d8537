"""Gram against standard Newton–Schulz in bf16 on ill-conditioned inputs, per restart schedule.

    python tools/gram_accuracy.py [--restarts 3 2 none] [--coefficients quintic polar_express]

For inputs with singular values log-spaced over 1e-4..1 (and one rank-deficient input):
each variant's error against a float64 standard iteration and the range of its output's
singular values (the nonzero ones), next to the standard bf16 path's. This is how the
default restart schedule (``muon_dist.kernels.gram.DEFAULT_RESTARTS``) was chosen: the
schedule whose range stays in the standard path's band at the lowest error. CUDA only.
"""

from __future__ import annotations

import argparse
import math

import torch

from muon_dist.kernels import newton_schulz, newton_schulz_torch

# (rows, cols, smallest singular value, rank or None)
INPUTS: list[tuple[int, int, float, int | None]] = [
    (1024, 4096, 1e-4, None),
    (1024, 4096, 1e-4, 256),
    (4096, 1024, 1e-3, None),
    (4096, 14336, 1e-4, None),
    (1024, 4096, 1e-2, None),
]


def conditioned(rows: int, cols: int, smallest: float, rank: int | None) -> torch.Tensor:
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, device="cuda"))
    v, _ = torch.linalg.qr(torch.randn(cols, k, device="cuda"))
    s = torch.logspace(0, math.log10(smallest), k, device="cuda")
    if rank is not None:
        s[rank:] = 0
    return (u * s) @ v.mT


def describe(out: torch.Tensor, ref: torch.Tensor, rank: int) -> str:
    o = out.double()
    gram = o @ o.mT if o.size(-2) <= o.size(-1) else o.mT @ o
    values = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)[:rank]
    err = ((o - ref).norm() / ref.norm()).item()
    return f"err {err:.2e}  singular values {values.min().item():.3f}..{values.max().item():.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", nargs="+", default=["3", "2", "none"])
    parser.add_argument("--coefficients", nargs="+", default=["quintic", "polar_express"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise RuntimeError("gram_accuracy.py measures bf16 on a CUDA GPU; run it on one")
    schedules = [() if r == "none" else tuple(int(k) for k in r.split(",")) for r in args.restarts]
    torch.manual_seed(0)
    for coefficients in args.coefficients:
        for rows, cols, smallest, rank in INPUTS:
            X = conditioned(rows, cols, smallest, rank)
            ref = newton_schulz_torch(X.double(), coefficients=coefficients, dtype=torch.float64)
            k = rank or min(rows, cols)
            print(f"{coefficients} {rows}x{cols} smallest {smallest:g} rank {k}", flush=True)
            print(f"  float64            {describe(ref, ref, k)}")
            for backend in ("torch", "triton"):
                out = newton_schulz(
                    X, coefficients=coefficients, backend=backend, method="standard"
                )
                print(f"  standard {backend:<9} {describe(out, ref, k)}")
            for restarts in schedules:
                for backend in ("torch", "triton"):
                    out = newton_schulz(
                        X,
                        coefficients=coefficients,
                        backend=backend,
                        method="gram",
                        gram_restarts=restarts,
                    )
                    label = f"gram {backend} {restarts}"
                    print(f"  {label:<18} {describe(out, ref, k)}", flush=True)


if __name__ == "__main__":
    main()
