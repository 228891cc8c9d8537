"""What a wing is: the part of a step an update rule brings, bound once to a plan.

A rule declares its wing (``Rule.wing``, :mod:`muon_dist.step.wings.registry` finds it);
the Muon phase binds one wing per rule its groups use and asks each, never a rule's name:
which buckets its own exchange moves (:attr:`Wing.packed`, :meth:`Wing.exchange`), what the
owner does around Newton–Schulz on a stack (:meth:`Wing.owner`), what a write does besides
(:meth:`Wing.write_part`), its state tensors (:meth:`Wing.bind_state`), and its work before
and after the buckets (:meth:`Wing.start`, :meth:`Wing.finish`). The base class is Muon's:
it adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.comm.exchange import BucketExchange, Exchanges
from muon_dist.comm.groups import CommGroups
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap, StackSpec
from muon_dist.plan.build import Plan
from muon_dist.step.bucket.orthogonalizer import OwnerPart
from muon_dist.step.shard.entries import MuonEntry
from muon_dist.step.shard.piece_writes import WritePart


@dataclass(frozen=True)
class WingSite:
    """What every wing of a phase is bound to: the plan, its views (``entries``, in plan
    order), each Muon tensor's views, the process groups, the bucket exchanges, the
    settings and the device."""

    plan: Plan
    entries: Sequence[MuonEntry]
    views_of: Sequence[Sequence[int]]
    comm: CommGroups
    exchanges: Exchanges
    settings: ExecutionSettings
    device: torch.device

    def tensors(self, views: frozenset[int]) -> list[int]:
        """The Muon tensors (by position) whose views are ``views``, in order."""
        return sorted({self.entries[i].tensor_index for i in views})

    def param(self, tensor: int) -> torch.Tensor:
        return self.entries[self.views_of[tensor][0]].param

    def group(self, tensor: int) -> dict[str, Any]:
        return self.entries[self.views_of[tensor][0]].group


class Wing:
    """A rule's wing on one plan: ``views`` are the plan's views of the groups under the
    rule. Muon's wing is this class: plain Newton–Schulz, a plain write, the packed
    exchange, no state of its own."""

    def __init__(self, site: WingSite, views: frozenset[int]) -> None:
        self.site, self.views = site, views

    @property
    def packed(self) -> frozenset[int]:
        """The buckets this wing's own exchange moves (only part of each piece travels, so
        no exchange buffer is a stack): known before the bucket maps are laid out."""
        return frozenset()

    def lay_out(self, maps: Sequence[BucketMap]) -> None:
        """The plan's bucket maps are laid out (stacks numbered across the plan)."""

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at this wing's state tensors (again after a state load)."""

    def owner(self, spec: StackSpec) -> OwnerPart:
        """The owner part of a stack of this rule's matrices, made on its first step."""
        return OwnerPart()

    def write_part(self) -> WritePart | None:
        """What a write of this rule's updates does besides (None: nothing)."""
        return None

    def exchange(self, index: int, where: BucketMap) -> BucketExchange | None:
        """Bucket ``index``'s transport, where it is one of :attr:`packed`."""
        return None

    def start(self) -> None:
        """Before a step's first bucket."""

    def finish(self, keep_of: Sequence[torch.Tensor]) -> None:
        """After a step's commit; ``keep_of`` per Muon tensor, whether the step keeps it."""
