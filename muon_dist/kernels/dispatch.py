"""Backend choice for Newton–Schulz: one entry point for the optimizer and for users."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients
from muon_dist.kernels.reference import DEFAULT_EPS, newton_schulz_torch

BACKENDS = ("auto", "torch", "triton")


def validate_backend(backend: str) -> None:
    """Reject unknown names and a Triton request on a machine that cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(BACKENDS)}")
    if backend == "triton" and not torch.cuda.is_available():
        raise RuntimeError(
            "backend='triton' needs a CUDA device and none is available; "
            "use backend='auto' or backend='torch' on this machine"
        )


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Orthogonalize a matrix or a batch of matrices (any leading dims); returns ``dtype``."""
    validate_backend(backend)
    return newton_schulz_torch(X, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
