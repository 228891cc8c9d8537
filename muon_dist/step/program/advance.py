"""The state advance of a step's program: the momenta whose view's record places their
advance at this point of the step (:meth:`muon_dist.step.shard.shard_io.ShardIO.momentum_at`,
the same answer the reads ask), decided when the program is bound, then Magma's scores and
the whole-tensor decay."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.rules.ops import decay_
from muon_dist.rules.registry import rule_of
from muon_dist.step.shard.entries import MuonTensors
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.piece_io import PieceIO
from muon_dist.step.shard.scalars import MuonScalars
from muon_dist.step.shard.shard_io import ShardIO


def advancing(
    tensors: MuonTensors, io: Sequence[ShardIO], mode: StepMode, place: str
) -> tuple[int, ...]:
    """The Muon tensors whose momentum a step of ``mode`` advances and stores at ``place``
    (their first view's record says where: :meth:`ShardIO.momentum_at`), decided when a
    program is bound."""
    return tuple(
        j for j, views in enumerate(tensors.views_of) if io[views[0]].momentum_at(mode) == place
    )


def advance_state(
    tensors: MuonTensors, pieces: PieceIO, scalars: MuonScalars, members: Sequence[int]
) -> None:
    """Advance and store the momenta of ``members`` (one foreach pass per coefficient, read
    from their groups each step), then Magma and the unfused decay."""
    state, grads = pieces.state, pieces.grads
    by_beta: dict[float, list[int]] = {}
    for j in members:
        group = tensors.groups[j]
        by_beta.setdefault(rule_of(group).momentum_carry(group), []).append(j)
    state.advance_momenta(by_beta, grads.tensors, grads.local, scalars.ok, scalars.keep_of)
    if state.magma:
        for j, damping in state.advance_magma(grads.tensors, scalars.keep_of).items():
            shape = (-1, *[1] * (tensors.shards[j].ndim - 1))
            for i in tensors.views_of[j]:
                scalars.magma_step_of[i] = (damping * scalars.step_of[i]).view(shape)
    _decay(tensors, pieces, scalars)


def _decay(tensors: MuonTensors, pieces: PieceIO, scalars: MuonScalars) -> None:
    """Tensors with a local gradient decay by their group's factor, one launch per group;
    the others by their own, which depends on the other ranks' gradients."""
    by_group: dict[int, list[torch.Tensor]] = {}
    alone: list[int] = []
    for j, views in enumerate(tensors.views_of):
        if not pieces.forms.io[views[0]].decays_tensor:
            continue
        if pieces.grads.local[j]:
            by_group.setdefault(tensors.group_of[j], []).append(tensors.shards[j])
        else:
            alone.append(j)
    for g, members in by_group.items():
        decay_(members, scalars.group_decay_of[g])
    if alone:
        decay_([tensors.shards[j] for j in alone], [scalars.decay_of[j] for j in alone])
