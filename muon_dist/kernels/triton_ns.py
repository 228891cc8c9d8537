"""Newton–Schulz on Triton symmetric kernels, with the torch backend's exact semantics.

Triton is imported only when a kernel runs, so ``import muon_dist`` works without it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.kernels.availability import interpret_mode, on_device
from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.gram import (
    DEFAULT_RESTARTS,
    gram_work_dtype,
    segments,
    validate_restarts,
)
from muon_dist.kernels.torch_ns import DEFAULT_EPS, as_stack

# Dtypes tl.dot takes with fp32 accumulation; float64 stays on the torch backend.
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def newton_schulz_triton(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Same contract as ``newton_schulz_torch``, with ``X·Xᵀ`` and ``b·A + c·A·A`` in Triton.

    The symmetric products use Triton: they compute half the tiles of a plain matmul,
    and their epilogues also apply the normalisation and add ``a·I``, so a step is three
    launches. So do the Frobenius norms (:func:`inverse_norms_triton`), which spread each
    matrix over many programs where torch's reduction leaves a GPU underused; they sum in
    another order than ``torch.linalg.vector_norm``, so they agree with the torch
    backend's within fp32 rounding, not bitwise. ``(a·I + B)·X`` is a general product and
    stays on ``torch.bmm`` (cuBLAS); a Triton variant is worth adding only if it measures
    faster there. Tall matrices take the Gram matrix ``Xᵀ·X`` from a transposed view, as
    the torch backend does, without a copy.
    """
    _check_runnable(X, dtype)
    schedule = resolve_coefficients(coefficients, steps)
    from muon_dist.kernels.triton_kernels import sym_product
    from muon_dist.kernels.triton_reduce import inverse_norms_triton

    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    # The input stack may be the caller's tensor: it is read, never overwritten.
    private = Y.untyped_storage().data_ptr() != X.untyped_storage().data_ptr()
    # Fold the normalisation into the first step's epilogues (see absorb_identity_): the
    # Gram matrix takes 1/s², B takes 1/s, and every B its a·I. The norm comes from the
    # stack, not the Gram trace, since the Gram epilogue already needs it.
    inverse, gram_scale = inverse_norms_triton(Y, schedule.norm_scale, eps)
    batch, m = Y.size(0), min(Y.size(-2), Y.size(-1))
    with on_device(Y.device):
        A = Y.new_empty(batch, m, m)
        B = torch.empty_like(A)
        spare = torch.empty_like(Y)
        for index, (a, b, c) in enumerate(schedule.steps):
            first = index == 0
            sym_product(Y.mT if tall else Y, out=A, scale=gram_scale if first else None)
            sym_product(A, out=B, alpha=c, Y=A, beta=b, diag=a, scale=inverse if first else None)
            if tall:
                torch.bmm(Y, B, out=spare)
            else:
                torch.bmm(B, Y, out=spare)
            Y, spare = spare, Y if private or index > 0 else torch.empty_like(Y)
    return Y.reshape(*X.shape[:-2], Y.size(-2), Y.size(-1))


def _check_runnable(X: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in TRITON_DTYPES:
        raise TypeError(
            f"the Triton Newton–Schulz runs in one of {TRITON_DTYPES}, got dtype={dtype}; "
            "use backend='torch' for other dtypes"
        )
    if not X.is_cuda and not interpret_mode():
        raise RuntimeError(
            f"the Triton Newton–Schulz needs a CUDA tensor, got one on {X.device}; move it to "
            "the GPU, use backend='torch', or set TRITON_INTERPRET=1 (slow, for tests)"
        )


def newton_schulz_gram_triton(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    restarts: Sequence[int] = DEFAULT_RESTARTS,
) -> torch.Tensor:
    """Gram Newton–Schulz (see :mod:`muon_dist.kernels.gram`) on the symmetric kernels.

    The symmetric m×m products run as half-tile :func:`sym_product` calls: per step one for
    ``P = a·I + b·R + c·R²``, one for ``Q ← P·Q`` (P and Q are polynomials of the first Gram
    matrix, so they commute and their product is symmetric) and one for ``R ← P·(P·R)ᵀ``
    after a general ``P·R`` on ``torch.bmm``. The stack is read
    only by each segment's Gram product and by ``Q·X`` (``torch.bmm``); the normalisation
    rides in the first Gram epilogue (``1/s²``) and in the epilogue of the first segment's
    last ``Q`` (``1/s``), which is written straight in ``dtype`` for that product.
    """
    _check_runnable(X, dtype)
    schedule = resolve_coefficients(coefficients, steps)
    schedule_segments = segments(steps, validate_restarts(restarts))
    from muon_dist.kernels.triton_kernels import sym_product
    from muon_dist.kernels.triton_reduce import inverse_norms_triton

    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    inverse, inverse_squared = inverse_norms_triton(Y, schedule.norm_scale, eps)
    batch, m = Y.size(0), min(Y.size(-2), Y.size(-1))
    with on_device(Y.device):
        R = Y.new_empty(batch, m, m, dtype=gram_work_dtype(dtype))
        R_next, P, PR, Q_a, Q_b = (torch.empty_like(R) for _ in range(5))
        left = Y.new_empty(batch, m, m)
        for segment in schedule_segments:
            first_segment = segment.start == 0
            gram_scale = inverse_squared if first_segment else None
            sym_product(Y.mT if tall else Y, out=R, scale=gram_scale)
            Q: torch.Tensor | None = None
            for index in segment:
                a, b, c = schedule.steps[index]
                last = index == segment.stop - 1
                scale = inverse if first_segment and last else None
                if Q is None:
                    # Q₁ = P: written where Q lives, or straight into the output factor.
                    Q = left if last else Q_a
                    sym_product(R, out=Q, alpha=c, Y=R, beta=b, diag=a, scale=scale)
                    step_P = Q
                else:
                    sym_product(R, out=P, alpha=c, Y=R, beta=b, diag=a)
                    target = left if last else (Q_b if Q is Q_a else Q_a)
                    Q = sym_product(P, Q=Q, out=target, scale=scale)
                    step_P = P
                if not last:
                    # R ← P·R·P = P·(P·R)ᵀ, symmetric by structure (see gram.py).
                    torch.bmm(step_P, R, out=PR)
                    sym_product(step_P, Q=PR, out=R_next)
                    R, R_next = R_next, R
            # Q is symmetric (its tiles are mirrored), so X_kᵀ = X₀ᵀ·Q for tall stacks.
            Y = torch.bmm(Y, left) if tall else torch.bmm(left, Y)
    return Y.reshape(*X.shape[:-2], Y.size(-2), Y.size(-1))
