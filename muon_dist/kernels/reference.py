"""Torch Newton–Schulz: the reference every backend is checked against."""

from __future__ import annotations

import torch

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients

DEFAULT_EPS = 1e-7


def as_stack(X: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``X`` as a ``[batch, m, n]`` stack in ``dtype`` (a view when it already is one)."""
    if X.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(X.shape)}"
        )
    return X.reshape(-1, X.size(-2), X.size(-1)).to(dtype)


def inverse_norms(Y: torch.Tensor, norm_scale: float, eps: float) -> torch.Tensor:
    """``1 / (norm_scale·‖Y[b]‖_F + eps)`` per matrix, shape ``[batch, 1, 1]``, fp32 or wider."""
    norm_dtype = torch.promote_types(Y.dtype, torch.float32)
    norm = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    return (norm * norm_scale + eps).reciprocal()


def normalize_gram_(A: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Turn the Gram matrix of an unnormalized stack into that of the normalized one.

    The first step works on ``X/s`` without materialising it: its Gram matrix is
    ``X·Xᵀ/s²``, a short-side square, which costs less than dividing the whole stack.
    """
    return A.mul_(inverse.square().to(A.dtype))


def absorb_identity_(
    B: torch.Tensor, a: float, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``B ← (a·I + B)·s⁻¹``, so a step's ``a·Y + B·Y`` becomes the single product ``B·Y``.

    ``baddbmm(Y, B, Y, beta=a)`` would first copy ``Y`` into its output, a full pass over
    the stack every step; adding ``a`` to the short-side diagonal costs nothing. The first
    step also passes ``inverse = 1/s`` to apply the Frobenius normalisation (see
    :func:`normalize_gram_`).
    """
    if inverse is None:
        B.diagonal(dim1=-2, dim2=-1).add_(a)
        return B
    B.mul_(inverse.to(B.dtype))
    B.diagonal(dim1=-2, dim2=-1).add_((a * inverse[..., 0]).to(B.dtype))
    return B


def newton_schulz_torch(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate the polar factor of each trailing matrix of ``X`` with matmuls.

    Runs in ``dtype`` and returns ``dtype``. The Gram matrix is always the short side's:
    tall matrices multiply on the right (``Xᵀ·X``, ``X·B``) instead of being transposed, so
    no step copies the stack. The Frobenius normalisation is folded into the first step
    (see :func:`normalize_gram_`), so the Gram matrix sees the raw squares. An all-zero
    matrix stays zero, and one whose Frobenius norm overflows (above about 1.8e19 in fp32
    or bf16) gives a non-finite result, which the optimizer reports, not zeros.
    """
    schedule = resolve_coefficients(coefficients, steps)
    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    inverse = inverse_norms(Y, schedule.norm_scale, eps)
    for index, (a, b, c) in enumerate(schedule.steps):
        A = Y.mT @ Y if tall else Y @ Y.mT
        if index == 0:
            normalize_gram_(A, inverse)
        B = absorb_identity_(
            torch.baddbmm(A, A, A, beta=b, alpha=c), a, inverse if index == 0 else None
        )
        Y = Y @ B if tall else B @ Y
    return Y.reshape(*X.shape[:-2], Y.size(-2), Y.size(-1))
