"""NorMuon's owner part: each output row of Newton–Schulz's result normalized by its running
second moment (:mod:`muon_dist.state.normuon_moments`, :mod:`muon_dist.rules.normuon_rows`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from muon_dist.state.normuon_moments import RowMoments, StackRows
from muon_dist.step.bucket.owner_part import OwnerPart


class RowNormalization(OwnerPart):
    """Newton–Schulz, then the rows normalized, for one stack whose rows are ``rows``."""

    def __init__(self, moments: RowMoments, rows: StackRows) -> None:
        self._moments, self._rows = moments, rows

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
        chosen: Sequence[torch.Tensor] | None,
    ) -> torch.Tensor:
        return self._moments.normalize(orthogonalize(x), self._rows, part)
