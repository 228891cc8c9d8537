"""Muon's wing: nothing besides the plain step (:class:`muon_dist.step.wings.base.Wing`)."""

from __future__ import annotations

from muon_dist.step.wings.base import Wing


class MuonWing(Wing):
    """Muon's wing, the base every other wing changes."""
