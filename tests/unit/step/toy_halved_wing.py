"""The toy rule's wing (toy_halved_rule.py): an owner part of its own, nothing else."""

from __future__ import annotations

from collections.abc import Callable

import torch

from muon_dist.plan.bucket_map import StackSpec
from muon_dist.step.bucket.orthogonalizer import OwnerPart
from muon_dist.step.wings.base import Wing


class Halving(OwnerPart):
    """Newton–Schulz, then the result halved."""

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
    ) -> torch.Tensor:
        return orthogonalize(x).mul_(0.5)


class HalvedWing(Wing):
    """The toy rule's wing: its stacks' owner part halves their result."""

    def owner(self, spec: StackSpec) -> OwnerPart:
        return Halving()
