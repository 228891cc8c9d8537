"""Backend choice for Newton–Schulz: one entry point for the optimizer and for users."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients
from muon_dist.kernels.reference import DEFAULT_EPS, newton_schulz_torch
from muon_dist.kernels.triton_ns import (
    TRITON_DTYPES,
    newton_schulz_triton,
    triton_available,
)

BACKENDS = ("auto", "torch", "triton")


def validate_backend(backend: str) -> None:
    """Reject unknown names and a Triton request on a machine that cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(BACKENDS)}")
    if backend == "triton" and not triton_available():
        raise RuntimeError(
            "backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU "
            "tests), and this machine lacks one; use backend='auto' or backend='torch' here"
        )


# Standard Newton–Schulz FLOPs per iteration, batch·(4m²n + 2m³), above which the Triton
# kernels won on an H200 (torch 2.11, Triton 3.6, bf16, benchmarks/bench_kernels.py and a
# sweep of 24 shapes): about 0.2 ms of matrix work per iteration. Below it Triton loses,
# up to 2x, to its per-launch CPU overhead and to too few 128-row tiles to fill the GPU.
TRITON_MIN_FLOP_PER_STEP = 1.6e11


def prefer_triton(m: int, n: int, batch: int) -> bool:
    """Whether the Triton kernels should beat torch for ``batch`` CUDA matrices of m×n.

    The symmetric kernels halve the FLOPs of the two Gram products, which pays only once
    there is enough work per call: e.g. one 3072² or 4096² matrix, 32×768×2048 experts, but
    not one 2048×8192 or 1024×4096 matrix, nor 8×256×1024. The threshold is a first
    measurement on one H200; retune it from benchmarks/bench_kernels.py on other GPUs.
    """
    small, large = min(m, n), max(m, n)
    return batch * (4 * small * small * large + 2 * small**3) >= TRITON_MIN_FLOP_PER_STEP


def _auto_uses_triton(X: torch.Tensor, dtype: torch.dtype) -> bool:
    # Cheapest checks first: small matrices are launch-bound, so microseconds show there.
    if X.ndim < 2 or not X.is_cuda or dtype not in TRITON_DTYPES:
        return False
    rows, cols = X.shape[-2:]
    batch = X.numel() // max(rows * cols, 1)
    return prefer_triton(rows, cols, batch) and triton_available()


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Orthogonalize a matrix or a batch of matrices (any leading dims); returns ``dtype``.

    "torch" runs the reference; "triton" the Triton kernels (CUDA tensors, or CPU tensors
    under TRITON_INTERPRET=1); "auto" takes Triton for CUDA tensors where
    ``prefer_triton`` says it is faster, torch otherwise.
    """
    validate_backend(backend)
    if backend == "triton" or (backend == "auto" and _auto_uses_triton(X, dtype)):
        return newton_schulz_triton(X, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
    return newton_schulz_torch(X, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
