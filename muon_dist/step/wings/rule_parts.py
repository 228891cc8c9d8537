"""The step-side parts of the update rules, made in one place: :func:`parts_of` is the only
reader of a rule's capability flags (``normalizes_rows``, ``selects_slices``).

A rule's *owner part* changes what the owner does around Newton–Schulz on a stack (NorMuon's
row normalization, :mod:`muon_dist.step.wings.normuon_owner`; Dion2's chosen slices,
:mod:`muon_dist.step.wings.dion2_owner`); its *write part* what the write of an update does besides
(Dion2's error feedback, :mod:`muon_dist.step.wings.dion2_feedback`). Muon has neither: its owner
part is plain Newton–Schulz (:class:`OwnerPart`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from muon_dist.rules.base import Rule, RulePart
from muon_dist.rules.registry import RULES, rule_of
from muon_dist.state.normuon_moments import RowMoments
from muon_dist.step.bucket.owner_part import OwnerPart
from muon_dist.step.wings.dion2_feedback import ErrorFeedback
from muon_dist.step.wings.dion2_owner import ChosenSlices
from muon_dist.step.wings.normuon_owner import RowNormalization


@dataclass(frozen=True)
class RuleParts:
    """One rule's step-side parts: whether its owner part reads per-row second moments
    (laid out in the state for its tensors), whether its owner orthogonalizes chosen slices
    only (its buckets then move only those), and its write part (None: none)."""

    row_moments: bool
    chosen_slices: bool
    write: ErrorFeedback | None

    def owner(self, recipe: RulePart, stack: int, moments: RowMoments, backend: str) -> OwnerPart:
        """The owner part of stack ``stack``, whose recipe holds ``recipe`` of the rule."""
        if self.chosen_slices and recipe.fraction is not None:
            return ChosenSlices(recipe.fraction, bool(recipe.transposed), backend)
        rows = moments.stacks.get(stack)
        if self.row_moments and rows is not None:
            return RowNormalization(moments, rows)
        return OwnerPart()


_FEEDBACK = ErrorFeedback()


def parts_of(rule: Rule) -> RuleParts:
    """The step-side parts of ``rule``."""
    return RuleParts(
        rule.normalizes_rows, rule.selects_slices, _FEEDBACK if rule.selects_slices else None
    )


def group_parts(group: dict[str, Any]) -> RuleParts:
    """The step-side parts of a Muon group's rule."""
    return parts_of(rule_of(group))


def recipe_parts(recipe: RulePart) -> RuleParts:
    """The step-side parts of the rule a stack recipe names."""
    return parts_of(RULES[recipe.name])


def row_moment_tensors(groups: Sequence[dict[str, Any]]) -> list[int]:
    """The Muon tensors (by position) whose rule's owner part reads row moments."""
    return [j for j, group in enumerate(groups) if group_parts(group).row_moments]
