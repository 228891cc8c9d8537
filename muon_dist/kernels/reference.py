"""Torch Newton–Schulz: the reference every backend is checked against."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients

DEFAULT_EPS = 1e-7


def newton_schulz_torch(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate the polar factor of each trailing matrix of ``X`` with matmuls.

    Runs in ``dtype`` and returns ``dtype``; callers cast. Tall matrices are transposed so
    the Gram matrix is the small side. An all-zero matrix stays zero since it is divided by
    ``eps`` only.
    """
    if X.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(X.shape)}"
        )
    schedule = resolve_coefficients(coefficients, steps)
    batch_shape = X.shape[:-2]
    Y = X.reshape(-1, X.size(-2), X.size(-1)).to(dtype)
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT
    norm_dtype = torch.promote_types(dtype, torch.float32)
    norm = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    Y = Y / (norm * schedule.norm_scale + eps).to(dtype)
    for a, b, c in schedule.steps:
        A = Y @ Y.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        Y = torch.baddbmm(Y, B, Y, beta=a, alpha=1.0)
    if tall:
        Y = Y.mT
    return Y.reshape(*batch_shape, Y.size(-2), Y.size(-1)).contiguous()
