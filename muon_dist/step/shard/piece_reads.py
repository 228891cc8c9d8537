"""Reads of Newton–Schulz inputs from pieces of local shards, compiled once per tuple of
pieces and step mode into a few batches, as the writes are
(:mod:`muon_dist.step.shard.piece_writes`): pieces whose momentum advances in the read
(:class:`AdvancingRead`, one pass per form and group) and pieces whose momentum advanced
before (:class:`MixingRead`, the Nesterov mix and the cast only). Where a view's momentum
advances is its record's answer for the mode
(:meth:`muon_dist.step.shard.shard_io.ShardIO.momentum_at`); the gradients are this step's
(:class:`LocalGrads`), their pieces' views kept while a gradient tensor stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.plan.build import Slices
from muon_dist.rules.ops import nesterov_mix, ns_inputs_, pre_orthogonalize_
from muon_dist.rules.registry import rule_of
from muon_dist.state.muon_state import MuonState

# A piece's gradient, as :meth:`LocalGrads.pieces` takes it: tensor, view key, slices (None
# where the piece is the whole local shard, decided when the read is compiled).
GradPiece = tuple[int, tuple[int, int], Slices | None]


class LocalGrads:
    """This step's local gradients of the Muon tensors (zeros where absent); the views of
    a gradient's pieces are kept while the gradient tensor stays the same. ``local`` (which
    tensors have a local gradient) is replaced only when it changes."""

    def __init__(self, shards: Sequence[torch.Tensor], state: MuonState) -> None:
        self._shards = list(shards)
        self._state = state
        # Empty until a step sets them (:meth:`set`, or :meth:`set_one` from a hook).
        self.tensors: list[torch.Tensor] = [shard.new_empty(0) for shard in self._shards]
        self.local: tuple[bool, ...] = (True,) * len(self._shards)  # has a local gradient
        self._sources: list[torch.Tensor | None] = [None] * len(self._shards)
        self._views: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in self._shards]

    def set(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Take this step's gradients; returns whether which tensors have one changed."""
        local = tuple([grad is not None for grad in grads])
        changed = local != self.local
        if changed:
            self.local = local
        sources = self._sources
        self._take(
            [j for j, grad in enumerate(grads) if grad is None or grad is not sources[j]], grads
        )
        return changed

    def set_one(self, j: int, grad: torch.Tensor | None) -> None:
        """Take tensor j's gradient (None: absent, read as zeros)."""
        if grad is None or grad is not self._sources[j]:
            self._take((j,), {j: grad})

    def _take(
        self,
        taken: Sequence[int],
        grads: Sequence[torch.Tensor | None] | Mapping[int, torch.Tensor | None],
    ) -> None:
        """Take the new gradients ``grads[j]`` of the tensors ``taken`` (None: zeros), with
        no call per tensor: after ``zero_grad(set_to_none=True)`` every gradient is new."""
        sources, views, tensors = self._sources, self._views, self.tensors
        for j in taken:
            grad = grads[j]
            if grad is None:
                grad = torch.zeros_like(self._shards[j])
            sources[j] = tensors[j] = grad
            if views[j]:
                views[j] = {}
        if taken:
            self._state.forget_grads(taken)

    def _piece(self, j: int, key: tuple[int, int], slices: Slices) -> torch.Tensor:
        view = self._views[j].get(key)
        if view is None:
            view = self._views[j][key] = self.tensors[j][slices]
        return view

    def pieces(self, pieces: Sequence[GradPiece]) -> list[torch.Tensor]:
        tensors = self.tensors
        return [tensors[j] if s is None else self._piece(j, key, s) for j, key, s in pieces]


@dataclass(frozen=True)
class AdvancingRead:
    """Pieces of one group whose momentum advances in the read, in one pass of one form
    (``fused``); stored only where ``store`` (a step that holds its writes reads the next
    momentum without keeping it, and stores it at the commit). β and the Nesterov mix are
    read from the group every step: a scheduler may change ``momentum``."""

    positions: tuple[int, ...]
    grads: tuple[GradPiece, ...]
    momenta: tuple[torch.Tensor, ...]
    keeps: tuple[torch.Tensor, ...]
    group: dict[str, Any]
    fused: bool
    store: bool

    def read(self, grads: LocalGrads, outs: Sequence[torch.Tensor]) -> None:
        group, pieces = self.group, grads.pieces(self.grads)
        pre_orthogonalize_(
            pieces,
            list(self.momenta),
            [outs[i] for i in self.positions],
            beta=rule_of(group).momentum_carry(group),
            mix=nesterov_mix(group["momentum"], group["nesterov"]),
            keeps=list(self.keeps),
            store=self.store,
            fused=self.fused,
        )


@dataclass(frozen=True)
class MixingRead:
    """Pieces of one group whose momentum advanced before the buckets: the Nesterov mix and
    the cast to the input's dtype."""

    positions: tuple[int, ...]
    grads: tuple[GradPiece, ...]
    momenta: tuple[torch.Tensor, ...]
    group: dict[str, Any]

    def read(self, grads: LocalGrads, outs: Sequence[torch.Tensor]) -> None:
        group, pieces = self.group, grads.pieces(self.grads)
        ns_inputs_(
            pieces,
            list(self.momenta),
            [outs[i] for i in self.positions],
            nesterov_mix(group["momentum"], group["nesterov"]),
        )


Read = AdvancingRead | MixingRead
