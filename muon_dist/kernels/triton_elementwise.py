"""Triton kernels for the memory-bound passes of a Muon step, one pass over memory each.

Torch needs two kernels for each of these passes, and its mixed-dtype adds (fp32 inputs,
bf16 output) are not vectorised. Importing this module imports Triton; the optimizer
reaches it through :mod:`muon_dist.kernels.elementwise` only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muon_dist.kernels.triton_ns import on_device

_BLOCK = 4096
_WARPS = 8


@triton.jit
def _momentum_input_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    grad_ptr,
    momentum_ptr,
    out_ptr,
    numel,
    beta,
    mix,
    NESTEROV: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``m' = g + beta·m`` (stored when STORE); ``out = g + mix·m'`` (NESTEROV) or ``m'``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    momentum = tl.load(momentum_ptr + offsets, mask=mask).to(tl.float32)
    # Round the new momentum to its storage dtype before the mix, as two torch adds would.
    momentum = (grad + beta * momentum).to(momentum_ptr.dtype.element_ty)
    if STORE:
        tl.store(momentum_ptr + offsets, momentum, mask=mask)
    if NESTEROV:
        update = grad + mix * momentum.to(tl.float32)
    else:
        update = momentum.to(tl.float32)
    tl.store(out_ptr + offsets, update.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_and_update_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    param_ptr,
    update_ptr,
    numel,
    decay,
    step,
    BLOCK: tl.constexpr,
):
    """``p = decay·p + step·u``, computed in fp32 and stored in the parameter's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    update = tl.load(update_ptr + offsets, mask=mask).to(tl.float32)
    param = decay * param + step * update
    tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)


def _grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _BLOCK),)


def momentum_input_triton(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    out: torch.Tensor,
    beta: float,
    mix: float | None,
    store: bool,
) -> None:
    """Triton form of :func:`muon_dist.kernels.elementwise.momentum_input_` (contiguous,
    same-shape tensors on one device)."""
    numel = grad.numel()
    if numel == 0:
        return
    with on_device(grad.device):
        _momentum_input_kernel[_grid(numel)](
            grad,
            momentum,
            out,
            numel,
            float(beta),
            float(mix or 0.0),
            NESTEROV=mix is not None,
            STORE=store,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )


def decay_and_update_triton(
    param: torch.Tensor, update: torch.Tensor, decay: float, step: float
) -> None:
    """Triton form of :func:`muon_dist.kernels.elementwise.decay_and_update_`."""
    numel = param.numel()
    if numel == 0:
        return
    with on_device(param.device):
        _decay_and_update_kernel[_grid(numel)](
            param, update, numel, float(decay), float(step), BLOCK=_BLOCK, num_warps=_WARPS
        )
