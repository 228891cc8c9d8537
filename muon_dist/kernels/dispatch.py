"""Backend choice for Newton–Schulz: one entry point for the optimizer and for users."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients
from muon_dist.kernels.reference import DEFAULT_EPS, newton_schulz_torch
from muon_dist.kernels.triton_ns import (
    TRITON_DTYPES,
    newton_schulz_triton,
    triton_available,
    triton_beats_cublas,
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


def prefer_triton(m: int, n: int, batch: int) -> bool:
    """Whether "auto" takes the Triton path for ``batch`` CUDA matrices of m×n.

    True when at least one of the two symmetric products (the Gram matrix and its square)
    is expected to beat cuBLAS; the other then stays on cuBLAS. E.g. one 4096² or
    4096×14336 matrix, 32×1536×4096 experts; not 1024×4096 nor 128×768×2048.
    """
    small, large = min(m, n), max(m, n)
    return triton_beats_cublas(batch, small, large) or triton_beats_cublas(batch, small, small)


def _auto_uses_triton(X: torch.Tensor, dtype: torch.dtype) -> bool:
    if X.ndim < 2 or not X.is_cuda or dtype not in TRITON_DTYPES or not triton_available():
        return False
    batch = X.numel() // max(X.size(-2) * X.size(-1), 1)
    return prefer_triton(X.size(-2), X.size(-1), batch)


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
    under TRITON_INTERPRET=1); "auto" takes Triton for CUDA tensors, for each symmetric
    product where it measured faster (``prefer_triton``), and torch otherwise.
    """
    validate_backend(backend)
    if backend == "triton" or (backend == "auto" and _auto_uses_triton(X, dtype)):
        return newton_schulz_triton(
            X,
            steps=steps,
            coefficients=coefficients,
            eps=eps,
            dtype=dtype,
            only_where_faster=backend == "auto",
        )
    return newton_schulz_torch(X, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
