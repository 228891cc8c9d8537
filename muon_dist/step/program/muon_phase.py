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

from muon_dist.runtime import Task, run_tasks
from muon_dist.step.bucket.bucket_task import bucket_task
from muon_dist.step.program.advance import StateAdvance
from muon_dist.step.program.binding import Bound, bind_state
from muon_dist.step.program.stages import PROGRAMS, Program, Stage
from muon_dist.step.shard.shard_io import MOMENTUM_AT_COMMIT, MOMENTUM_BEFORE


class MuonPhase:
    """The Muon phase of every step for one plan: its parts, bound once
    (:func:`muon_dist.step.program.binding.bind`), and each mode's program run over them.
    Its ``inputs`` are the step's host values, staged by the runner before each step."""

    def __init__(self, bound: Bound) -> None:
        self.plan, self.settings = bound.plan, bound.settings
        self.agreement, self.inputs = bound.agreement, bound.inputs
        self.tensors = bound.tensors
        self.maps = bound.maps
        self.wings = bound.wings  # by rule name
        self.unique_wings = bound.unique_wings  # each once
        self.scalars = bound.scalars
        self.pieces = bound.pieces
        self.orthogonalizer = bound.orthogonalizer
        self.failures = bound.failures
        self.transaction = bound.transaction
        self.tools = bound.tools  # per mode
        self.programs = {mode: StepProgram(self, program) for mode, program in PROGRAMS.items()}

    @property
    def error(self) -> Exception | None:
        """The first exception this rank's own work raised in the last run (raised by
        ``step()`` once the other ranks know, through the result flags)."""
        return self.failures.error

    def shard_io_table(self) -> str:
        """Where each view's shard read, write, momentum, decay and write part's feedback
        happen, as printable text (:mod:`muon_dist.step.shard.shard_io`)."""
        return self.pieces.forms.table()

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the momentum buffers, Magma scores and the wings' state tensors (again
        after a state load)."""
        bind_state(self.tensors, self.pieces.state, self.unique_wings, state)
        self.pieces.bind()

    # -- the step -----------------------------------------------------------------------

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """This step's local gradients (None where absent), read by the bucket tasks."""
        if self.pieces.grads.set(grads):
            self.pieces.forget_writes()


class StepProgram:
    """One mode's program (:data:`muon_dist.step.program.stages.PROGRAMS`) bound to a
    phase: which tensors each of its state advances moves and what its bucket tasks work
    with are decided here, once; a step then runs its stages."""

    def __init__(self, phase: MuonPhase, program: Program) -> None:
        self.phase, self.stages = phase, program
        mode = program.mode
        self._tools = phase.tools[mode]
        io = phase.pieces.forms.io
        self._before = StateAdvance(phase.tensors, io, mode, MOMENTUM_BEFORE)
        self._at_commit = StateAdvance(phase.tensors, io, mode, MOMENTUM_AT_COMMIT)

    def bucket(self, index: int) -> Task:
        """Bucket ``index``'s task, in plan order."""
        phase = self.phase
        bucket, where = phase.plan.buckets[index], phase.maps[index]
        exchanges = (w.exchange(index, where) for w in phase.unique_wings)
        exchange = next((x for x in exchanges if x is not None), None)
        return bucket_task(bucket, where, self._tools, exchange)

    def run(self, grads: Sequence[torch.Tensor | None]) -> None:
        """One Muon phase on the local gradients ``grads`` (None where absent), after the
        agreement decided on them: the opening, every bucket, the closing."""
        phase = self.phase
        phase.set_grads(grads)
        self.open()
        buckets = (self.bucket(i) for i in range(len(phase.plan.buckets)))
        run_tasks(buckets, phase.settings.max_inflight)
        self.close()

    def open(self) -> None:
        """The stages before the buckets."""
        for stage in self.stages.opening:
            self._run(stage)

    def close(self) -> None:
        """The stages after the buckets."""
        for stage in self.stages.closing:
            self._run(stage)

    def _run(self, stage: Stage) -> None:
        """One stage (:class:`Stage` says what each does)."""
        phase = self.phase
        scalars, agreement, pieces = phase.scalars, phase.agreement, phase.pieces
        match stage:
            case Stage.OPEN:
                phase.failures.reset()
                agreement.clear_results()
            case Stage.SCALARS:
                scalars.stage(agreement.keep, agreement.found_inf, phase.inputs, drop=True)
            case Stage.DROP_NONE:
                scalars.drop_none()
            case Stage.ADVANCE:
                self._before.run(pieces, scalars)
            case Stage.HOLD:
                phase.transaction.begin()
            case Stage.START:
                for wing in phase.unique_wings:
                    wing.start()
            case Stage.AGREE | Stage.AGREE_KEPT:
                orthogonalizer = phase.orthogonalizer
                agreement.count_bad_results(
                    orthogonalizer.sums,
                    orthogonalizer.stack_tensor,
                    scalars.dropped if stage is Stage.AGREE_KEPT else None,
                )
                agreement.agree_on_results()
            case Stage.SKIP:
                agreement.skip_on_results()
            case Stage.COMMIT:
                held = phase.transaction.end()
                scalars.stage(agreement.keep, agreement.found_inf, phase.inputs, drop=False)
                self._at_commit.run(pieces, scalars)
                pieces.commit(held)
            case Stage.FINISH:
                for wing in phase.unique_wings:
                    wing.finish(scalars.keep_of)
