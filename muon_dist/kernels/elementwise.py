"""The memory-bound passes of a Muon step: torch everywhere, one fused Triton pass on CUDA.

Both forms compute the same formula in fp32; they differ only in rounding the intermediate
that the fused pass never stores, so tests hold them to a few ulps of each other.
"""

from __future__ import annotations

import torch

from muon_dist.kernels.triton_ns import triton_available

# Below this many elements the fused pass loses: a Triton launch costs about 20 us of CPU
# against 12-18 us for torch's two kernels, and a small piece moves few bytes either way. On
# an H200 (benchmarks/bench_elementwise.py, 2026-11-22) the two tie near 1M elements and the
# fused pass is 1.5x faster from 4M, up to 1.6x (momentum) and 2.3x (update) at 16M+.
FUSED_MIN_NUMEL = 1 << 21


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether the Triton pass should run: large contiguous CUDA tensors of one shape."""
    first = tensors[0]
    return (
        first.is_cuda
        and first.numel() >= FUSED_MIN_NUMEL
        and all(t.shape == first.shape and t.is_contiguous() for t in tensors)
        and triton_available()
    )


def advance_momentum(
    grad: torch.Tensor, momentum: torch.Tensor, beta: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``beta·momentum + grad`` in one torch pass (into ``out`` when given, e.g. the buffer)."""
    return torch.add(grad, momentum, alpha=beta, out=out)


def nesterov_input_(
    grad: torch.Tensor, momentum: torch.Tensor, out: torch.Tensor, mix: float | None
) -> None:
    """Write Newton–Schulz's input from an advanced momentum into ``out``: ``g + mix·m``,
    or ``m`` when ``mix`` is None, in one torch pass that casts on the way."""
    if mix is None:
        out.copy_(momentum)
    else:
        torch.add(grad, momentum, alpha=mix, out=out)


def momentum_input_(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    out: torch.Tensor,
    beta: float,
    mix: float | None,
    store: bool = True,
) -> None:
    """Advance the momentum, ``m' = beta·m + g``, and write Newton–Schulz's input into ``out``.

    The input is the Nesterov mix ``g + mix·m'``, or ``m'`` itself when ``mix`` is None, cast
    to ``out``'s dtype on the way. ``m'`` replaces ``momentum`` only when ``store`` is true: a
    step that may still be skipped reads the next momentum without keeping it.
    """
    if _fused(grad, momentum, out):
        from muon_dist.kernels.triton_elementwise import momentum_input_triton

        momentum_input_triton(grad, momentum, out, beta, mix, store)
        return
    advanced = advance_momentum(grad, momentum, beta, out=momentum if store else None)
    nesterov_input_(grad, advanced, out, mix)


def decay_and_update_(param: torch.Tensor, update: torch.Tensor, decay: float, step: float) -> None:
    """``param ← decay·param + step·update``: decoupled weight decay and the Muon update."""
    if _fused(param, update):
        from muon_dist.kernels.triton_elementwise import decay_and_update_triton

        decay_and_update_triton(param, update, decay, step)
        return
    if decay != 1.0:
        param.mul_(decay)
    param.add_(update, alpha=step)
