"""Each rule's wing, found by the name the rule declares (``Rule.wing``, "module:Class"): a
rule sits below the step and cannot import its wing, so the step imports it here, once."""

from __future__ import annotations

import importlib
from functools import cache

from muon_dist.rules.base import Rule
from muon_dist.step.wings.base import Wing


@cache
def _wing(path: str) -> type[Wing]:
    module, _, name = path.partition(":")
    found = getattr(importlib.import_module(module), name)
    if not (isinstance(found, type) and issubclass(found, Wing)):
        raise TypeError(f"muon_dist: {path!r} is no Wing subclass")
    return found


def wing_of(rule: Rule) -> type[Wing]:
    """The wing class ``rule`` declares."""
    return _wing(rule.wing)
