"""What the agreement decides from its flags: ``found_inf`` and the keep mask, and the count
of non-finite results.

Each decision is one function with its torch form and its fused form
(:mod:`muon_dist.kernels.triton_agreement`: one launch instead of up to a dozen tiny ones),
which write the same bits, since maxima, comparisons and counts round nowhere. ``fused``
chooses; the agreement passes it."""

from __future__ import annotations

import torch


def settle_(
    checked: torch.Tensor,
    present: torch.Tensor,
    muon_index: torch.Tensor,
    found_inf: torch.Tensor,
    keep: torch.Tensor,
    compared: dict[str, torch.Tensor] | None = None,
    differs: torch.Tensor | None = None,
    *,
    fused: bool,
) -> None:
    """A step's ``found_inf`` and ``keep`` mask from its flags.

    Args:
        checked: non-negative fp32 flags (``found_inf`` may be one); any above 0 sets
            ``found_inf`` (to 1).
        present: fp32 per parameter, > 0 where some rank has its gradient.
        muon_index: int64, each Muon tensor's position among the parameters.
        found_inf: fp32, one element, written: min(1, max(checked)), raised to 1 where the
            ranks differ.
        keep: bool per Muon tensor, written: present and nothing found.
        compared: the all-reduced comparison (``values``, ``negated``, ``norms``,
            ``negated_norms``, ``digests``; fp32): the ranks differ where a value's or a
            norm's maximum plus its negated minimum is positive, or the digests differ.
        differs: bool, one element, written with ``compared``: whether the ranks differ.
        fused: one Triton launch instead of torch's chain.
    """
    if (compared is None) != (differs is None):
        raise ValueError("settle_ takes compared and differs together, or neither")
    if fused:
        from muon_dist.kernels.triton_agreement import settle_triton

        settle_triton(checked, present, muon_index, found_inf, keep, compared, differs)
        return
    found_inf.copy_(checked.amax().clamp_(max=1.0))  # ``checked`` may hold found_inf
    if compared is not None and differs is not None:
        # max + (-min) > 0 where ranks differ; -inf + -inf where no rank has a value.
        spread = torch.cat(
            [
                compared["values"] + compared["negated"],
                compared["norms"] + compared["negated_norms"],
            ]
        )
        digests = compared["digests"]
        torch.logical_or((spread > 0).any(), digests.amax() > digests.amin(), out=differs)
        torch.maximum(found_inf, differs.to(found_inf.dtype), out=found_inf)
    torch.logical_and(present.index_select(0, muon_index) > 0, found_inf == 0, out=keep)


def count_bad_(
    sums: torch.Tensor,
    tensors: torch.Tensor,
    results: torch.Tensor,
    dropped: torch.Tensor | None = None,
    *,
    fused: bool,
) -> None:
    """Add 1.0 to ``results[tensors[i]]`` (fp32) for each matrix i whose fp32 ``sums[i]``
    is not finite, leaving out those ``dropped`` (bool) marks where given. ``fused``: one
    Triton launch."""
    if fused:
        from muon_dist.kernels.triton_agreement import count_bad_triton

        count_bad_triton(sums, tensors, results, dropped)
        return
    finite = torch.isfinite(sums)
    if dropped is not None:
        finite.logical_or_(dropped)
    results.index_add_(0, tensors, finite.logical_not_().float())
