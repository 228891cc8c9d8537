"""Newton–Schulz on Triton symmetric kernels, with the reference's exact semantics.

Triton is imported only when a kernel runs, so ``import muon_dist`` works without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.reference import DEFAULT_EPS, as_stack, inverse_norms

# Dtypes tl.dot takes with fp32 accumulation; float64 stays on the torch reference.
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), as it decides."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """True where the Triton backend can run: Triton imports and CUDA or the interpreter is on."""
    return _triton_importable() and (torch.cuda.is_available() or interpret_mode())


def newton_schulz_triton(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Same contract as ``newton_schulz_torch``, with ``X·Xᵀ`` and ``b·A + c·A·A`` in Triton.

    Only the symmetric products use Triton: they compute half the tiles of a plain matmul,
    and their epilogues also apply the normalisation and add ``a·I``, so a step is three
    launches. ``(a·I + B)·X`` is a general product and stays on ``torch.bmm`` (cuBLAS); a Triton
    variant is worth adding only if it measures faster there. Tall matrices take the Gram
    matrix ``Xᵀ·X`` from a transposed view, as the torch reference does, without a copy.
    """
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
    schedule = resolve_coefficients(coefficients, steps)
    from muon_dist.kernels.triton_kernels import sym_product

    Y = as_stack(X, dtype)
    tall = Y.size(-2) > Y.size(-1)
    # The input stack may be the caller's tensor: it is read, never overwritten.
    private = Y.untyped_storage().data_ptr() != X.untyped_storage().data_ptr()
    # Fold the normalisation into the first step's epilogues (see absorb_identity_): the
    # Gram matrix takes 1/s², B takes 1/s, and every B its a·I. The norm comes from the
    # stack, not the Gram trace, since the Gram epilogue already needs it.
    inverse = inverse_norms(Y, schedule.norm_scale, eps)
    gram_scale = inverse.square()
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


def on_device(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Triton launches on the current CUDA device, which need not be the tensor's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
