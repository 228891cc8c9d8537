"""The three forms a write of updates to local-shard pieces takes (which one, per view, is
its :class:`muon_dist.step.shard.shard_io.ShardIO` record's ``write``): fused, batched, single.

Each form is laid out once per tuple of pieces (:meth:`muon_dist.step.shard.piece_io.PieceIO.write`)
with the views and one-element scalars it needs, and writes a step's updates with no further
decision but the ones a step's values make (Magma's per-row steps, an unchecked step's mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from muon_dist.plan.packing import Runs, flat_views, runs_numel
from muon_dist.rules.ops import (
    drop_unkept,
    error_feedback_,
    fused_updates_,
    post_orthogonalize_,
    shared_step_updates_,
    updates_,
)
from muon_dist.step.shard.scalars import MuonScalars


class Feedback(Protocol):
    """A piece's pass on its momentum with the write of its update (Dion2's error feedback,
    :func:`muon_dist.rules.ops.error_feedback_`): the momentum view and β, read at every
    write."""

    def args(self) -> tuple[torch.Tensor, float]: ...


class WritePart(Protocol):
    """What a rule's write does besides adding the update (its wing's): each written
    piece's :class:`Feedback`."""

    def of_piece(self, momentum: torch.Tensor, group: dict[str, Any]) -> Feedback: ...


@dataclass(frozen=True)
class Batch:
    """Pieces written together: their positions in the tuple, their parameter views, their
    tensors' keep flags and their feedbacks (None where the rule has none); ``unchecked``
    where they write a transaction's held updates (non-finite where not kept)."""

    positions: tuple[int, ...]
    targets: tuple[torch.Tensor, ...]
    keeps: tuple[torch.Tensor, ...]
    feedbacks: tuple[Feedback | None, ...]
    unchecked: bool = False


@dataclass(frozen=True)
class FusedWrite:
    """Form "fused": decay, step, add and Dion2's feedback of all its pieces, one launch;
    the kernel skips the write where ``keep`` is false, so an unchecked step needs no mask."""

    batch: Batch
    decays: tuple[torch.Tensor, ...]
    steps: tuple[torch.Tensor, ...]

    def of_held(self) -> FusedWrite:
        """The same write of a transaction's held updates."""
        return replace(self, batch=replace(self.batch, unchecked=True))

    def write(self, updates: Sequence[torch.Tensor], scalars: MuonScalars) -> None:
        batch = self.batch
        fused_updates_(
            list(batch.targets),
            [updates[i] for i in batch.positions],
            decays=list(self.decays),
            steps=list(self.steps),
            keeps=list(batch.keeps),
            feedbacks=[None if f is None else f.args() for f in batch.feedbacks],
        )


@dataclass(frozen=True)
class BatchedWrite:
    """Form "batched": pieces of one step class and dtype whose tensors have a local
    gradient share a step (``shared``: the class; three launches: cast, scale, add, into
    one flat scratch laid out as ``runs``, masked in one pass when unchecked); the others
    take their own ``steps`` in one foreach. Dion2's feedback runs first, piece by piece."""

    batch: Batch
    backend: str  # whether the feedback fuses
    steps: tuple[torch.Tensor, ...] = ()
    shared: int | None = None  # the step class
    dtype: torch.dtype = torch.float32
    runs: Runs = ()

    def of_held(self) -> BatchedWrite:
        """The same write of a transaction's held updates."""
        return replace(self, batch=replace(self.batch, unchecked=True))

    def write(self, updates: Sequence[torch.Tensor], scalars: MuonScalars) -> None:
        batch = self.batch
        mine = [updates[i] for i in batch.positions]
        if batch.unchecked and self.shared is None:
            mine = [drop_unkept(u, keep) for u, keep in zip(mine, batch.keeps, strict=True)]
        for update, keep, fed in zip(mine, batch.keeps, batch.feedbacks, strict=True):
            if fed is not None:
                momentum, beta = fed.args()
                error_feedback_(momentum, update, beta, keep, self.backend)
        if self.shared is None:
            updates_(batch.targets, mine, self.steps)
            return
        device = batch.targets[0].device
        scratch = torch.empty(runs_numel(self.runs), dtype=self.dtype, device=device)
        shared_step_updates_(
            batch.targets,
            mine,
            scalars.class_step_of[self.shared],
            scratch,
            flat_views(scratch, self.runs),
            scalars.ok if batch.unchecked else None,
        )


@dataclass(frozen=True)
class SingleWrite:
    """Form "single": one piece under cautious decay (it needs the update's sign) or Magma
    (a per-row step, set each step: ``rows`` is the piece's rows of it)."""

    position: int
    index: int
    rows: slice
    target: torch.Tensor
    step: torch.Tensor
    keep: torch.Tensor
    cautious: torch.Tensor | None
    feedback: Feedback | None
    unchecked: bool = False

    def of_held(self) -> SingleWrite:
        """The same write of a transaction's held updates."""
        return replace(self, unchecked=True)

    def write(self, updates: Sequence[torch.Tensor], scalars: MuonScalars) -> None:
        update = updates[self.position]
        if self.unchecked:
            update = drop_unkept(update, self.keep)
        magma_step = scalars.magma_step_of.get(self.index)
        post_orthogonalize_(
            self.target,
            update,
            step=self.step if magma_step is None else magma_step[self.rows],
            keep=self.keep,
            cautious=self.cautious,
            feedback=None if self.feedback is None else self.feedback.args(),
        )


Write = FusedWrite | BatchedWrite | SingleWrite
