"""NorMuon's row normalization as batched ops, written for one matrix ``[m, n]`` or a stack
``[k, m, n]`` alike (rows on the last but one dimension): the reference
(:mod:`muon_dist.rules.normuon`) and the owner's batched form run the same functions."""

from __future__ import annotations

import torch

from muon_dist.rules.forms import fused_form, fused_launches


def row_squares(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares in fp32, shape ``[..., m]``, read straight from ``rows``
    (any dtype, any strides: a transposed view costs no copy); summed over a matrix's
    holders (each row counted once) they are the whole matrix's."""
    norms: torch.Tensor = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32)
    return norms.square()


def second_moment_next(
    second_moment: torch.Tensor,
    squares: torch.Tensor,
    beta2: float | torch.Tensor,
    weight: float | torch.Tensor,
) -> torch.Tensor:
    """``β₂·v + (1 − β₂)·squares / n``, with ``weight = (1 − β₂) / n``. Two products and a
    sum, each rounded once, so every rank that computes it from the same values agrees
    bitwise, whatever the layout of the vectors."""
    return second_moment * beta2 + squares * weight


def row_factors(
    squares: torch.Tensor, second_moment: torch.Tensor, eps: float | torch.Tensor
) -> torch.Tensor:
    """Each row's factor in ``Ô = O / (√v + ε)`` rescaled to ``O``'s Frobenius norm, per
    matrix (fp32, shape of ``squares``).

    Both norms come from the row sums of squares: ``‖Ô‖² = Σᵢ squaresᵢ / (√vᵢ + ε)²``.
    A zero matrix (dropped by the step) gets zero factors and stays zero.
    """
    denom = second_moment.sqrt() + eps
    before = squares.sum(-1, keepdim=True)
    after = (squares / denom.square()).sum(-1, keepdim=True)
    ratio = (before / after.clamp_min(torch.finfo(torch.float32).tiny)).sqrt()
    return ratio / denom


def owner_row_factors(
    squares: torch.Tensor,
    index: torch.Tensor,
    coefficients: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    primary: torch.Tensor | None,
    sums: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """An owner's NorMuon factors for ``[k, m]`` row ``squares`` whose rows lie at
    ``index`` in the per-row vectors ``coefficients`` (current moment, β₂, weight, ε):
    :func:`second_moment_next` then :func:`row_factors`; the squares are also written to
    ``sums`` at ``index`` (zero for the matrices not ``primary``, ``[k, 1]``). On CUDA one
    Triton launch replaces about twenty small ones (:func:`fused_launches`)."""
    current, beta2, weight, eps = coefficients
    if fused_launches(backend, squares):
        from muon_dist.kernels.triton_elementwise import row_factors_triton

        return row_factors_triton(squares, index, current, beta2, weight, eps, primary, sums)
    moment = second_moment_next(current[index], squares, beta2[index], weight[index])
    reported = squares if primary is None else torch.where(primary, squares, 0.0)
    sums.index_copy_(0, index.reshape(-1), reported.reshape(-1))
    return row_factors(squares, moment, eps[index])


def scale_rows_(
    x: torch.Tensor, factors: torch.Tensor, *, columns: bool = False, backend: str = "torch"
) -> None:
    """``x``'s rows (columns with ``columns``: a matrix stored ``[in, out]``) times their
    fp32 ``factors``, in place, the product rounded once to ``x``'s dtype.

    One pass over ``x``; torch's broadcast multiply is not vectorised, so on CUDA the fused
    Triton pass runs where :func:`fused_form` chooses it (a contiguous ``x``).
    """
    if not x.is_contiguous() and x.mT.is_contiguous():
        x, columns = x.mT, not columns  # Newton–Schulz hands tall matrices back transposed
    if fused_form(backend, x):
        from muon_dist.kernels.triton_elementwise import scale_rows_triton

        scale_rows_triton(x, factors, columns)
        return
    x.mul_(factors.unsqueeze(-2) if columns else factors.unsqueeze(-1))
