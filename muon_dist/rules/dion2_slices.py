"""Dion2's slice selection as batched ops: the norms of slices, the top ones, and Newton–Schulz
on the chosen slices only (the rule itself is :mod:`muon_dist.rules.dion2`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from muon_dist.kernels.tables import tables_allowed
from muon_dist.rules.forms import fused_form, fused_launches


def slice_axis(out_dim: int, in_dim: int, transposed: bool) -> int:
    """The axis of a stored matrix along which Dion2 selects: its output rows when it has no
    more outputs than inputs, else its input columns (-2: rows, -1: columns)."""
    outputs = -1 if transposed else -2
    if out_dim <= in_dim:
        return outputs
    return -1 if outputs == -2 else -2


def selected_count(length: int, fraction: float) -> int:
    """How many of ``length`` slices Dion2 orthogonalizes: ``⌈fraction·length⌉``, at least 1."""
    return min(length, max(1, math.ceil(fraction * length)))


def slice_norms(x: torch.Tensor, axis: int, backend: str = "torch") -> torch.Tensor:
    """The L1 norm of each slice of each matrix of ``x`` (``[..., m, n]``) along ``axis``
    (-2: rows, -1: columns), summed in float64: exact for bf16 entries within 2^45 of each
    other and, for fp32 ones, rounded far below their own precision, so the same for any
    batching or summation order. On CUDA a
    fused Triton pass reads ``x`` in place (torch would first copy it to float64)."""
    if x.ndim == 3 and fused_form(backend, x):
        from muon_dist.kernels.triton_elementwise import slice_l1_triton

        return slice_l1_triton(x, axis)
    return x.abs().sum(-1 if axis == -2 else -2, dtype=torch.float64)


def add_slice_norms_(
    norms: torch.Tensor,
    xs: Sequence[torch.Tensor],
    axes: Sequence[int],
    slots: Sequence[torch.Tensor],
    backend: str = "torch",
) -> None:
    """Add :func:`slice_norms` of each ``[k, m, n]`` tensor of ``xs`` (along its axis) into
    the float64 vector ``norms`` at its ``slots`` (``[k, slices]``): the pieces' partial
    norms of the slices they hold. On CUDA one Triton launch for all
    (:func:`fused_launches`: it saves a launch per piece) where an address table may be
    made (:func:`~muon_dist.kernels.tables.tables_allowed`)."""
    if xs and fused_launches(backend, xs[0]) and tables_allowed(xs[0].device):
        from muon_dist.kernels.triton_elementwise import add_slice_l1_triton

        add_slice_l1_triton(norms, xs, axes, slots)
        return
    for x, axis, where in zip(xs, axes, slots, strict=True):
        norms.index_add_(0, where.reshape(-1), slice_norms(x, axis).reshape(-1))


def select_slices(x: torch.Tensor, axis: int, count: int, backend: str = "torch") -> torch.Tensor:
    """The ``count`` slices of each matrix of ``x`` (``[..., m, n]``) along ``axis`` (-2:
    rows, -1: columns) with the largest L1 norms (:func:`slice_norms`), ascending (shape
    ``[..., count]``); ties go to the lower index (a stable sort), so the choice depends on
    the values only, never on how they were batched or laid out."""
    return top_slices(slice_norms(x, axis, backend), count)


def top_slices(norms: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the ``count`` largest of each row of ``norms`` (``[..., L]``),
    ascending; ties go to the lower position (a stable sort)."""
    order = torch.sort(norms, dim=-1, descending=True, stable=True).indices
    return order[..., :count].sort(dim=-1).values


def selected_orthogonalize(
    x: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    fraction: float,
    transposed: bool,
    backend: str = "torch",
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dion2's Newton–Schulz: ``orthogonalize`` on the selected slices of each matrix of
    ``x`` (``[..., m, n]``, stored ``[in, out]`` when ``transposed``), zero elsewhere.

    The slices are output rows when a matrix has no more outputs than inputs, else input
    columns; ``index`` (``[..., count]``, ascending) names them where they were chosen
    before (from norms summed across ranks), else :func:`select_slices` chooses. Every
    entry of a selected slice that comes out zero is stored as ``-0.0``, so the result
    alone marks the selection (:func:`muon_dist.rules.ops.selected_mask`) wherever it travels.
    """
    rows, cols = x.shape[-2], x.shape[-1]
    out_dim, in_dim = (cols, rows) if transposed else (rows, cols)
    axis = slice_axis(out_dim, in_dim, transposed)
    count = selected_count(x.shape[axis], fraction)
    if index is None:
        index = select_slices(x, axis, count, backend)
    if axis == -2:
        spread = index.unsqueeze(-1).expand(*index.shape, cols)
    else:
        spread = index.unsqueeze(-2).expand(*index.shape[:-1], rows, count)
    result = orthogonalize(torch.gather(x, axis, spread))
    result = torch.where(result == 0, -0.0, result)
    return result.new_zeros(x.shape).scatter_(axis, spread, result)
