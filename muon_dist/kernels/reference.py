"""Torch Newton–Schulz: the reference every backend is checked against."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients

DEFAULT_EPS = 1e-7


def normalized_stack(
    X: torch.Tensor, norm_scale: float, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, bool]:
    """``X`` as a contiguous ``[batch, m, n]`` stack in ``dtype`` with m <= n, divided by its
    Frobenius norm; also whether it was transposed. Shared by every backend so they agree.
    """
    if X.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(X.shape)}"
        )
    Y = X.reshape(-1, X.size(-2), X.size(-1)).to(dtype)
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT
    norm_dtype = torch.promote_types(dtype, torch.float32)
    norm = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    # Dividing into a fresh contiguous buffer also materialises the transpose, once.
    out = torch.empty(Y.shape, dtype=dtype, device=Y.device)
    return torch.div(Y, (norm * norm_scale + eps).to(dtype), out=out), tall


def restore_shape(Y: torch.Tensor, tall: bool, like: torch.Tensor) -> torch.Tensor:
    """Undo :func:`normalized_stack`'s transpose and flattening of the batch dims."""
    if tall:
        Y = Y.mT
    return Y.reshape(*like.shape[:-2], Y.size(-2), Y.size(-1)).contiguous()


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
    schedule = resolve_coefficients(coefficients, steps)
    Y, tall = normalized_stack(X, schedule.norm_scale, eps, dtype)
    for a, b, c in schedule.steps:
        A = Y @ Y.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        Y = torch.baddbmm(Y, B, Y, beta=a, alpha=1.0)
    return restore_shape(Y, tall, X)
