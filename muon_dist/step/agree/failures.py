"""Where a failure of this rank's own work in a step is flagged, so that every rank learns
of it through the agreement's result flags."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.plan.bucket_map import LocalSlices
from muon_dist.plan.indices import TensorIndex
from muon_dist.step.agree.agreement import Agreement


class Failures:
    """The first exception this rank's own work (Newton–Schulz, a read or a write of an
    update) raised in a step, flagged in the agreement's result flags: the other ranks learn
    of it there instead of waiting in a collective this rank never joins."""

    def __init__(
        self, agreement: Agreement, rank: int, tensor_of_view: Sequence[TensorIndex]
    ) -> None:
        self.error: Exception | None = None
        self._agreement = agreement
        self._rank = rank
        self._tensor_of_view = tensor_of_view
        self._device = agreement.keep.device

    def reset(self) -> None:
        self.error = None

    def of_tensors(self, exc: Exception, tensors: torch.Tensor | Sequence[int]) -> None:
        """Record ``exc`` on the Muon tensors ``tensors`` (their positions)."""
        self.error = self.error or exc
        if not isinstance(tensors, torch.Tensor):
            tensors = torch.tensor(list(tensors), dtype=torch.long, device=self._device)
        self._agreement.record_failure(self._rank, tensors)

    def of_pieces(self, exc: Exception, pieces: Sequence[LocalSlices]) -> None:
        """Record ``exc`` on the tensors of ``pieces``."""
        self.of_tensors(exc, [self._tensor_of_view[view] for view, _ in pieces])
