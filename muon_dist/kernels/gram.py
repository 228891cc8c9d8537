"""Gram Newton–Schulz: the same polynomial iteration, run on the short side's Gram matrix.

For a wide ``X`` (m×n, m ≤ n; tall matrices work on their transpose through views), a step
``X ← P(A)·X`` with ``A = X·Xᵀ`` and ``P(A) = a·I + b·A + c·A²`` only ever multiplies ``X`` on
the left by a polynomial of the first Gram matrix ``R₀ = X₀·X₀ᵀ``. So ``X_k = Q_k·X₀`` with
``Q_{k+1} = P_k·Q_k`` and ``A_{k+1} = P_k·A_k·P_k`` (all polynomials of ``R₀`` commute, so Q
and A stay symmetric), and the iteration runs on m×m matrices: ``m³``-type products per step
instead of ``m²n``, plus one ``R₀`` and one ``Q·X₀`` at each end. In exact arithmetic this is
the standard iteration; in finite precision ``Q`` grows (its eigenvalues reach ``1/σ`` for
small singular values σ) and drifts from ``R``, so a *restart* forms ``X_k = Q_k·X₀`` and a
fresh Gram matrix at chosen steps. The m×m state runs in a working dtype chosen per output
dtype (:func:`gram_work_dtype`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.torch_ns import (
    DEFAULT_EPS,
    as_stack,
    gram_inverse_norms,
    scale_matrices_,
)

METHODS = ("auto", "gram", "standard")

# Steps (0-based) before which the Gram iteration restarts from X_k = Q_k·X₀. Without a
# restart, Q's growth (up to ~10³ for small singular values) amplifies rounding; one restart
# after three steps gave the lowest error of the schedules tried at the cost of one
# (benchmarks/README.md, "Thresholds in the code").
DEFAULT_RESTARTS: tuple[int, ...] = (3,)


def validate_method(method: str) -> None:
    """Reject a Newton–Schulz method name that is not one of :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(
            f"method={method!r} is not a Newton–Schulz method; choose one of {list(METHODS)}"
        )


def validate_restarts(restarts: Sequence[int]) -> tuple[int, ...]:
    """Sorted unique restart steps; each must be an integer >= 1 (step 0 starts fresh anyway).

    Steps at or past the iteration's length have no effect, so one schedule serves any
    ``steps``.
    """
    try:
        values = tuple(sorted({int(k) for k in restarts}))
        exact = all(isinstance(k, int) and not isinstance(k, bool) for k in restarts)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"gram_restarts={restarts!r} must be a sequence of step indices >= 1, e.g. (2,)"
        ) from exc
    if not exact or any(k < 1 for k in values):
        raise ValueError(
            f"gram_restarts={restarts!r} must be a sequence of integer step indices >= 1, "
            "e.g. (2,) to restart before the third step, or () for none"
        )
    return values


def gram_work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the m×m state (R, P, Q) for an iteration whose output is ``dtype``.

    bf16 outputs keep the state in fp16: its entries stay O(1) for R and P and below about
    10³ for Q (the product of the a coefficients between restarts), well inside fp16's
    range, and fp16's 3 extra mantissa bits keep Q's drift near the standard path's bf16
    error, at the same tensor-core rate. Other dtypes keep their own.
    """
    return torch.float16 if dtype == torch.bfloat16 else dtype


def segments(steps: int, restarts: tuple[int, ...]) -> list[range]:
    """The step ranges between restarts: ``segments(5, (2,)) == [range(0, 2), range(2, 5)]``."""
    bounds = [0, *(k for k in restarts if k < steps), steps]
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def wide_gram(Z: torch.Tensor) -> torch.Tensor:
    """``Z·Zᵀ`` accumulated in fp32 and returned in fp32 (or wider), for any input dtype.

    The Gram matrix's rounding is what the iteration amplifies: ``Q`` multiplies errors in
    ``R`` by up to the product of the a coefficients between restarts. Rounded to bf16
    (2⁻⁹) the bf16 results' singular values spread past 1.3 where the standard path's stay
    below 1.15; kept to fp32 and rounded once to the fp16 working dtype (2⁻¹¹) they stay
    in the standard path's band. On CUDA, cuBLAS writes fp32 straight from bf16 operands.
    """
    wide = torch.promote_types(Z.dtype, torch.float32)
    if Z.dtype == wide:
        return Z @ Z.mT
    if Z.is_cuda:
        return torch.bmm(Z, Z.mT, out_dtype=wide)
    return Z.to(wide) @ Z.to(wide).mT


def newton_schulz_gram_torch(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    restarts: Sequence[int] = DEFAULT_RESTARTS,
) -> torch.Tensor:
    """Gram Newton–Schulz with torch products; same contract as ``newton_schulz_torch``.

    The stack is read at each segment's start (its Gram matrix) and end (``Q·X``); between
    restarts only m×m matrices are multiplied. The Frobenius normalisation is folded into
    the first Gram matrix (``1/s²``, read off its trace) and into the first ``Q`` (``1/s``),
    so the stack is never divided. An all-zero matrix stays zero.
    """
    schedule = resolve_coefficients(coefficients, steps)
    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    work = gram_work_dtype(dtype)
    for segment in segments(steps, validate_restarts(restarts)):
        R = wide_gram(Y.mT if tall else Y)
        inverse = None
        if segment.start == 0:
            inverse = gram_inverse_norms(R, schedule.norm_scale, eps)
            scale_matrices_(R, inverse.square())
        R = R.to(work)
        P = _polynomial(R, schedule.steps[segment.start])
        Q = P
        for index in segment[1:]:
            # P·R·P rather than R·P²: symmetric by structure, not only through P and R
            # commuting, which rounding breaks; in fp16 it kept the error at the standard
            # path's level where R·P² doubled it.
            R = P @ (R @ P)
            P = _polynomial(R, schedule.steps[index])
            Q = P @ Q
        left = Q.to(dtype)
        if inverse is not None:
            scale_matrices_(left, inverse)
        # Tall stacks hold X_kᵀ = X₀ᵀ·Q_kᵀ: the transpose is a view, not a copy.
        Y = Y @ left.mT if tall else left @ Y
    return Y.reshape(*X.shape[:-2], Y.size(-2), Y.size(-1))


def _polynomial(R: torch.Tensor, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """``a·I + b·R + c·R²`` for a stack of symmetric ``R``."""
    a, b, c = coefficients
    P = torch.baddbmm(R, R, R, beta=b, alpha=c)
    P.diagonal(dim1=-2, dim2=-1).add_(a)
    return P
