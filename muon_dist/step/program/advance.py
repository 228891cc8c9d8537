"""The state advance of a step's program: the momenta whose view's record places their
advance at this point of the step (:meth:`muon_dist.step.shard.shard_io.ShardIO.momentum_at`,
the same answer the reads ask), decided when the program is bound, then Magma's scores and
the whole-tensor decay."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from muon_dist.rules.ops import decay_
from muon_dist.rules.registry import rule_of
from muon_dist.step.shard.entries import MuonTensors
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.piece_io import PieceIO
from muon_dist.step.shard.scalars import MuonScalars
from muon_dist.step.shard.shard_io import ShardIO

# Tensors decayed together: their shards and one factor for all, or one factor each.
DecayBatch = tuple[list[torch.Tensor], torch.Tensor | list[torch.Tensor]]


class StateAdvance:
    """The momenta a step of ``mode`` advances and stores at ``place`` (their first view's
    record says where: :meth:`ShardIO.momentum_at`), by group, chosen when a program is
    bound; then Magma and the unfused decay, whose batches are laid out again only when
    which tensors have a local gradient changes."""

    def __init__(
        self, tensors: MuonTensors, io: Sequence[ShardIO], mode: StepMode, place: str
    ) -> None:
        self.tensors = tensors
        members: dict[int, list[int]] = {}
        for j, views in enumerate(tensors.views_of):
            if io[views[0]].momentum_at(mode) == place:
                members.setdefault(tensors.group_of[j], []).append(j)
        self._by_group = tuple((tensors.groups[js[0]], js) for js in members.values())
        self._decaying = tuple(
            j for j, views in enumerate(tensors.views_of) if io[views[0]].decays_tensor
        )
        self._decays: tuple[tuple[bool, ...], list[DecayBatch]] | None = None

    def run(self, pieces: PieceIO, scalars: MuonScalars) -> None:
        """Advance and store the momenta (one foreach pass per coefficient, read from their
        groups each step), then Magma and the unfused decay."""
        tensors, state, grads = self.tensors, pieces.state, pieces.grads
        state.advance_momenta(
            self._by_beta(), grads.tensors, grads.local, scalars.ok, scalars.keep_of
        )
        if state.magma:
            for j, damping in state.advance_magma(grads.tensors, scalars.keep_of).items():
                shape = (-1, *[1] * (tensors.shards[j].ndim - 1))
                for i in tensors.views_of[j]:
                    scalars.magma_step_of[i] = (damping * scalars.step_of[i]).view(shape)
        for params, factors in self._decay_batches(grads.local, scalars):
            decay_(params, factors)

    def _by_beta(self) -> dict[float, list[int]]:
        """The members by momentum coefficient, in tensor order."""
        by_beta: dict[float, list[int]] = {}
        for group, members in self._by_group:
            by_beta.setdefault(_carry(group), []).extend(members)
        if len(by_beta) < len(self._by_group):  # groups of one coefficient share a pass
            for members in by_beta.values():
                members.sort()
        return by_beta

    def _decay_batches(self, local: tuple[bool, ...], scalars: MuonScalars) -> list[DecayBatch]:
        """Tensors with a local gradient decay by their group's factor, one launch per group;
        the others by their own, which depends on the other ranks' gradients."""
        if self._decays is not None and self._decays[0] is local:
            return self._decays[1]
        shards, group_of = self.tensors.shards, self.tensors.group_of
        by_group: dict[int, list[torch.Tensor]] = {}
        alone = [j for j in self._decaying if not local[j]]
        for j in self._decaying:
            if local[j]:
                by_group.setdefault(group_of[j], []).append(shards[j])
        batches: list[DecayBatch] = [(m, scalars.group_decay_of[g]) for g, m in by_group.items()]
        if alone:
            batches.append(([shards[j] for j in alone], [scalars.decay_of[j] for j in alone]))
        self._decays = (local, batches)
        return batches


def _carry(group: dict[str, Any]) -> float:
    return rule_of(group).momentum_carry(group)
