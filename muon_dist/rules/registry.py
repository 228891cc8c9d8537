"""The update rules by name: the one place a rule's name is compared."""

from __future__ import annotations

from typing import Any

from muon_dist.rules.base import Rule
from muon_dist.rules.dion2 import Dion2
from muon_dist.rules.muon import MuonRule
from muon_dist.rules.normuon import NorMuon

RULES: dict[str, Rule] = {rule.name: rule for rule in (MuonRule(), NorMuon(), Dion2())}


def rule_of(group: dict[str, Any]) -> Rule:
    """The update rule of a Muon group (its ``"rule"``, checked when the group was added)."""
    return RULES[group["rule"]]


def fp32_state() -> tuple[str, ...]:
    """Every rule's own fp32 state keys."""
    return tuple(key for rule in RULES.values() for key in rule.fp32_state)
