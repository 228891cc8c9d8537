"""What an owner does around Newton–Schulz on a stack: Muon's plain form, which every rule's
owner part (:mod:`muon_dist.step.wings.rule_parts`) changes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class OwnerPart:
    """Muon's owner part: Newton–Schulz of the input as it is. ``graphed``: whether its
    Newton–Schulz replays from CUDA graphs whatever the stack's size."""

    graphed = False

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
        chosen: Sequence[torch.Tensor] | None,
    ) -> torch.Tensor:
        """The owner's result for ``x`` (a stack, or one part of its matrices: ``part``);
        ``chosen``: slices chosen before, per part (Dion2's buckets)."""
        return orthogonalize(x)
