"""Newton–Schulz in torch: the production backend off CUDA and for small stacks on CUDA,
and the semantics the Triton backend matches."""

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


def _inverse(norm: torch.Tensor, norm_scale: float, eps: float) -> torch.Tensor:
    return (norm * norm_scale + eps).reciprocal()


def inverse_norms(Y: torch.Tensor, norm_scale: float, eps: float) -> torch.Tensor:
    """``1 / (norm_scale·‖Y[b]‖_F + eps)`` per matrix, shape ``[batch]``, fp32 or wider."""
    norm_dtype = torch.promote_types(Y.dtype, torch.float32)
    return _inverse(torch.linalg.vector_norm(Y, dim=(-2, -1), dtype=norm_dtype), norm_scale, eps)


def gram_inverse_norms(A: torch.Tensor, norm_scale: float, eps: float) -> torch.Tensor:
    """:func:`inverse_norms` of a stack from its Gram matrices ``A = X·Xᵀ``: ``‖X‖_F² = tr(A)``.

    Reads ``m`` diagonal entries per matrix instead of the whole stack. The diagonal holds
    squared row norms rounded once to ``A``'s dtype, so in bf16 the norm is within a
    relative 2⁻⁹ of the exact one (typically far closer), which only shifts where the
    iteration starts inside its convergence band.
    """
    norm_dtype = torch.promote_types(A.dtype, torch.float32)
    trace = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=norm_dtype)
    return _inverse(trace.sqrt(), norm_scale, eps)


# From this many elements per matrix on, a per-matrix scale runs as one vectorised foreach
# launch per matrix; smaller matrices take one broadcast multiply over the whole stack:
# below this size the per-matrix launches cost more than the vectorised pass saves
# (benchmarks/README.md, "Thresholds in the code").
FOREACH_SCALE_MIN_NUMEL = 1 << 22


def scale_matrices_(X: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``X[b] *= factors[b]`` for a ``[batch, m, n]`` stack, with the factor rounded to X's dtype.

    A multiply by a ``[batch, 1, 1]`` tensor runs torch's strided broadcast kernel, which
    moves bf16 at about 60% of the rate of a contiguous kernel; ``_foreach_mul_`` by a 0-dim
    tensor of X's dtype runs the vectorised multi-tensor kernel, one launch per matrix.
    """
    factors = factors.to(X.dtype)
    if X.is_cuda and X.size(-2) * X.size(-1) >= FOREACH_SCALE_MIN_NUMEL:
        for matrix, factor in zip(X.unbind(0), factors.unbind(0), strict=True):
            torch._foreach_mul_([matrix], factor)
        return X
    return X.mul_(factors.view(-1, 1, 1))


def absorb_identity_(
    B: torch.Tensor, a: float, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``B ← (a·I + B)·s⁻¹``, so a step's ``a·Y + B·Y`` becomes the single product ``B·Y``.

    ``baddbmm(Y, B, Y, beta=a)`` would first copy ``Y`` into its output, a full pass over
    the stack every step; adding ``a`` to the short-side diagonal costs nothing. The first
    step also passes ``inverse = 1/s`` (one per matrix) to apply the Frobenius
    normalisation: it works on ``X/s`` without dividing the stack, since the Gram matrix
    of ``X/s`` is ``X·Xᵀ/s²``, a short-side square.
    """
    if inverse is None:
        B.diagonal(dim1=-2, dim2=-1).add_(a)
        return B
    scale_matrices_(B, inverse)
    B.diagonal(dim1=-2, dim2=-1).add_((a * inverse).to(B.dtype).unsqueeze(-1))
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
    (see :func:`absorb_identity_`) and its norm read off the first Gram matrix's trace
    (:func:`gram_inverse_norms`), so the Gram matrix sees the raw squares. An all-zero
    matrix stays zero, and one whose Frobenius norm overflows (above about 1.8e19 in fp32
    or bf16) gives a non-finite result, which the optimizer reports, not zeros.
    """
    schedule = resolve_coefficients(coefficients, steps)
    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    for index, (a, b, c) in enumerate(schedule.steps):
        A = Y.mT @ Y if tall else Y @ Y.mT
        inverse = None
        if index == 0:
            inverse = gram_inverse_norms(A, schedule.norm_scale, eps)
            scale_matrices_(A, inverse.square())
        B = absorb_identity_(torch.baddbmm(A, A, A, beta=b, alpha=c), a, inverse)
        Y = Y @ B if tall else B @ Y
    return Y.reshape(*X.shape[:-2], Y.size(-2), Y.size(-1))
