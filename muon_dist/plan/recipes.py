"""What an owner runs on a stack of matrices besides their shape: its recipe, the same for
every matrix of the stack."""

from __future__ import annotations

from dataclasses import dataclass

from muon_dist.plan.views import PartSplit
from muon_dist.rules.base import RulePart

# Coefficients as a recipe holds them: a schedule's name, or (a, b, c) per iteration.
CoefficientsKey = str | tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class StackRecipe:
    """Newton–Schulz's iterations, coefficients and method, the parts it cuts each matrix into
    (with their lr scales), and the rule's own part (NorMuon's row normalization reads the
    orientation; Dion2's selection also the fraction)."""

    iterations: int
    coefficients: CoefficientsKey
    parts: PartSplit | None
    method: str
    rule: RulePart
