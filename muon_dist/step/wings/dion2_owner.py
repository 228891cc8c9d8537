"""Dion2's owner part: Newton–Schulz on each matrix's chosen slices only
(:func:`muon_dist.rules.dion2_slices.selected_orthogonalize`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from muon_dist.rules.dion2_slices import selected_orthogonalize
from muon_dist.step.bucket.owner_part import OwnerPart


class ChosenSlices(OwnerPart):
    """Newton–Schulz on the chosen slices (``fraction`` of them) of each matrix of a stack
    stored ``transposed`` or not. Its stacks, a share of the slices, replay from graphs
    whatever their size: launching their Newton–Schulz costs the host more than the GPU's
    work."""

    graphed = True

    def __init__(self, fraction: float, transposed: bool, backend: str) -> None:
        self._fraction, self._transposed, self._backend = fraction, transposed, backend

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
        chosen: Sequence[torch.Tensor] | None,
    ) -> torch.Tensor:
        # A part is handed over by output rows, whatever the storage.
        transposed = self._transposed and part is None
        index = None if chosen is None else chosen[part or 0]
        return selected_orthogonalize(
            x, orthogonalize, self._fraction, transposed, self._backend, index
        )
