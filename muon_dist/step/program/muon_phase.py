"""The Muon phase of a step, bound once to a plan: one program per step mode.

agree (by the caller) → the program's opening (:mod:`muon_dist.step.program.stages`:
scalars, state advanced where the mode's records say, writes held where the mode holds them,
the wings started) → buckets (:mod:`muon_dist.step.bucket.bucket_task`: Newton–Schulz input
read by :mod:`muon_dist.step.shard.piece_io`, gather, orthogonalize, scatter, update
written) → the program's closing (agreement on the results, the commit of what was held,
the wings finished). Fusion changes which kernel runs a stage, never the order.

Everything a step repeats is decided when the plan is bound
(:mod:`muon_dist.step.program.binding`): the local shards, the bucket maps, the device
scalars, which pieces take the fused form, each rule's wing. A steady-state step then only
launches work: it builds no plan, reads no device value and makes new views only of its
fresh buffers, a few per run of like pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from muon_dist.comm.groups import CommGroups
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.build import Plan
from muon_dist.runtime import Task, run_tasks
from muon_dist.state.tensors import local
from muon_dist.step.agree.agreement import Agreement
from muon_dist.step.bucket.bucket_task import bucket_task
from muon_dist.step.program.advance import advance_state
from muon_dist.step.program.binding import bind
from muon_dist.step.program.stages import PROGRAMS, Stage
from muon_dist.step.shard.entries import MuonEntry
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.scalars import StepInputs
from muon_dist.step.shard.shard_io import MOMENTUM_AT_COMMIT, MOMENTUM_BEFORE, format_shard_io_table
from muon_dist.step.wings.base import Wing


class MuonPhase:
    """The Muon phase of every step for one plan: its parts bound once
    (:class:`muon_dist.step.program.binding.Bound`), and each mode's program run over them.
    ``inputs`` are the step's host values, staged by the runner before each step."""

    def __init__(
        self,
        plan: Plan,
        entries: Sequence[MuonEntry],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        group_count: int,
        comm: CommGroups,
        agreement: Agreement,
        inputs: StepInputs,
    ) -> None:
        self.plan, self.settings, self.agreement, self.inputs = plan, settings, agreement, inputs
        bound = bind(plan, entries, state, settings, group_count, comm, agreement)
        self.tensors = bound.tensors
        self.maps = bound.maps
        self.wings = bound.wings  # by rule name
        self.scalars = bound.scalars
        self.pieces = bound.pieces
        self.orthogonalizer = bound.orthogonalizer
        self.failures = bound.failures
        self.transaction = bound.transaction
        self.tools = bound.tools  # per mode

    @property
    def bound_wings(self) -> list[Wing]:
        """Each wing once, in the order the plan's views first name them."""
        return list({id(w): w for w in self.wings.values()}.values())

    @property
    def error(self) -> Exception | None:
        """The first exception this rank's own work raised in the last run (raised by
        ``step()`` once the other ranks know, through the result flags)."""
        return self.failures.error

    def shard_io_table(self) -> str:
        """Where each view's shard read, write, momentum, decay and Dion2's feedback
        happen, as printable text (:mod:`muon_dist.step.shard.shard_io`)."""
        return format_shard_io_table(self.pieces.forms.io)

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the momentum buffers, Magma scores and the wings' state tensors (again
        after a state load)."""
        momenta = [local(state[p]["momentum_buffer"]) for p in self.tensors.params]
        self.pieces.state.bind(state, momenta)
        for wing in self.bound_wings:
            wing.bind_state(state)
        self.pieces.bind()

    # -- the step -----------------------------------------------------------------------

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """This step's local gradients (None where absent), read by the bucket tasks."""
        if self.pieces.grads.set(grads):
            self.pieces.forget_writes()

    def bucket(self, index: int, mode: StepMode) -> Task:
        """Bucket ``index``'s task, in plan order, in a step of ``mode``."""
        bucket, where = self.plan.buckets[index], self.maps[index]
        exchanges = (w.exchange(index, where) for w in self.bound_wings)
        exchange = next((x for x in exchanges if x is not None), None)
        return bucket_task(bucket, where, self.tools[mode], exchange)

    def run(self, grads: Sequence[torch.Tensor | None], mode: StepMode) -> None:
        """One Muon phase of ``mode`` on the local gradients ``grads`` (None where absent),
        after the agreement decided on them: the program's opening, every bucket, its
        closing."""
        self.set_grads(grads)
        self.open(mode)
        buckets = (self.bucket(i, mode) for i in range(len(self.plan.buckets)))
        run_tasks(buckets, self.settings.max_inflight)
        self.close(mode)

    def open(self, mode: StepMode) -> None:
        """The stages of ``mode``'s program before its buckets."""
        for stage in PROGRAMS[mode].opening:
            self.run_stage(stage, mode)

    def close(self, mode: StepMode) -> None:
        """The stages of ``mode``'s program after its buckets."""
        for stage in PROGRAMS[mode].closing:
            self.run_stage(stage, mode)

    def run_stage(self, stage: Stage, mode: StepMode) -> None:
        """One stage of a program (:class:`Stage` says what each does)."""
        scalars, agreement = self.scalars, self.agreement
        match stage:
            case Stage.OPEN:
                self.failures.reset()
                agreement.clear_results()
            case Stage.SCALARS:
                scalars.stage(agreement.keep, agreement.found_inf, self.inputs)
                scalars.drop_unkept()
            case Stage.DROP_NONE:
                scalars.drop_none()
            case Stage.ADVANCE:
                advance_state(self.tensors, self.pieces, scalars, mode, MOMENTUM_BEFORE)
            case Stage.HOLD:
                self.transaction.begin()
            case Stage.START:
                for wing in self.bound_wings:
                    wing.start()
            case Stage.AGREE | Stage.AGREE_KEPT:
                finite = self.orthogonalizer.finite()
                if stage is Stage.AGREE_KEPT:
                    finite.logical_or_(scalars.dropped)
                bad = finite.logical_not_().float()
                agreement.count_bad_results(self.orthogonalizer.stack_tensor, bad)
                agreement.agree_on_results()
            case Stage.SKIP:
                agreement.skip_on_results()
            case Stage.COMMIT:
                held = self.transaction.end()
                scalars.stage(agreement.keep, agreement.found_inf, self.inputs)
                advance_state(self.tensors, self.pieces, scalars, mode, MOMENTUM_AT_COMMIT)
                self.pieces.commit(held)
            case Stage.FINISH:
                for wing in self.bound_wings:
                    wing.finish(scalars.keep_of)
