"""Dion2's write part: error feedback on the momentum of the slices its owner orthogonalized,
applied with the write of the update (:func:`muon_dist.rules.ops.error_feedback_`)."""

from __future__ import annotations

from typing import Any

import torch


class Feedback:
    """One piece's error feedback: its momentum view and its group, whose β is read at
    every write (a scheduler may change it between steps)."""

    def __init__(self, momentum: torch.Tensor, group: dict[str, Any]) -> None:
        self.momentum, self.group = momentum, group

    def args(self) -> tuple[torch.Tensor, float]:
        return self.momentum, self.group["momentum"]


class ErrorFeedback:
    """Dion2's write part: it makes each written piece's :class:`Feedback`."""

    def of_piece(self, momentum: torch.Tensor, group: dict[str, Any]) -> Feedback:
        return Feedback(momentum, group)
