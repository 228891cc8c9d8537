"""A toy rule with an owner part of a new kind, for test_wings.py: Muon's step on half the
orthogonalized update. This file is the rule (its reference, then its Rule, which declares
its wing, toy_halved_wing.py); the test adds the one registry line."""

from __future__ import annotations

from collections.abc import Callable

import torch

from muon_dist.rules import muon
from muon_dist.rules.base import MatrixStep, Rule


def reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    step: MatrixStep,
) -> None:
    """One step of one matrix: Muon's, the orthogonalized update halved on the owner."""
    muon.reference(param, grad, momentum, lambda u: orthogonalize(u) * 0.5, step)


class Halved(Rule):
    """Muon's step with half the orthogonalized update."""

    name = "halved"
    wing = "toy_halved_wing:HalvedWing"
