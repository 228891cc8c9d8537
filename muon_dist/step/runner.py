"""The step machinery behind :meth:`muon_dist.Muon.step`, built once per set of groups.

A step, in order: stage the host's values into device memory (:class:`StepInputs`), agree
on the gradients (:mod:`muon_dist.step.agree.agreement`), run the Muon phase
(:mod:`muon_dist.step.program.muon_phase`), run torch's fused AdamW on the other groups, and
queue the outcome's host copy. Under ``cuda_graph=True`` that device work is captured once and
replayed (:mod:`muon_dist.step.launch.cuda_graph`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Replicate

from muon_dist.comm.groups import CommGroups
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.build import build_plan, placement_of
from muon_dist.plan.indices import GroupIndex, TensorIndex
from muon_dist.plan.recipes import StackRecipe
from muon_dist.plan.views import MatrixView, matrix_views, named_params
from muon_dist.rules.registry import rule_of
from muon_dist.state.tensors import local, storage
from muon_dist.step.adamw_phase import AdamWPhase
from muon_dist.step.agree.agreement import Agreement
from muon_dist.step.agree.grad_check import GradReader
from muon_dist.step.agree.report import Outcome
from muon_dist.step.changes import BuiltFrom, GroupWatch
from muon_dist.step.launch.backward import BackwardStart
from muon_dist.step.launch.cuda_graph import StepGraph
from muon_dist.step.program.binding import bind
from muon_dist.step.program.muon_phase import MuonPhase
from muon_dist.step.shard.entries import MuonEntry
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.scalars import StepInputs

logger = logging.getLogger(__name__)

# Group entries that a step may find changed at every step: the lr (a scheduler's; staged
# into device memory every step) and bookkeeping. A captured step reads none of them, nor
# the parameter lists (a change is refused); any other change is captured anew.
_PER_STEP = frozenset({"lr", "initial_lr", "steps", "skipped_steps"})
_NOT_CAPTURED = (*_PER_STEP, "params", "param_names")


def _travelling_share(group: dict[str, Any], settings: ExecutionSettings, peers: int) -> float:
    """The part of a matrix the bucket budget counts: Dion2's fraction of its slices where
    only they travel (among several ``peers``, uncaptured: a captured step's exchange
    sizes are fixed, so whole matrices travel there), else all of it."""
    if peers > 1 and not settings.cuda_graph:
        return rule_of(group).travelling_share(group)
    return 1.0


def stack_recipe(group: dict[str, Any], view: MatrixView) -> StackRecipe:
    """The recipe of ``view``'s matrices in ``group``."""
    coefficients = group["coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(tuple(float(v) for v in t) for t in coefficients)
    return StackRecipe(
        group["ns_steps"],
        coefficients,
        view.part_split(group["adjust_lr"]),
        group["ns_method"],
        rule_of(group).stack_part(group, view.transposed),
    )


def muon_entries(groups: Sequence[dict[str, Any]]) -> tuple[list[MuonEntry], list[int]]:
    """Every matrix view of the Muon parameters, in plan order, and each Muon parameter's
    position among all parameters."""
    group_index = {id(g): i for i, g in enumerate(groups)}
    entries: list[MuonEntry] = []
    positions: list[int] = []
    for position, (name, group, p) in enumerate(named_params(groups)):
        if group["algorithm"] != "muon":
            continue
        first = 0
        for view in matrix_views(p.shape, group, name):
            tensor, index = TensorIndex(len(positions)), GroupIndex(group_index[id(group)])
            entries.append(MuonEntry(p, group, view, view.label(name), first, tensor, index))
            first += view.count
        positions.append(position)
    return entries, positions


class StepRunner:
    """Everything a step repeats, built once: the Muon phase, the agreement, the device
    copy of this step's host values, the AdamW tensors, and the CUDA graph when enabled."""

    def __init__(
        self,
        groups: Sequence[dict[str, Any]],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        comm: CommGroups,
    ) -> None:
        self.settings = settings
        self.built = BuiltFrom(groups)
        # The groups as the last checked step left them (muon_dist.Muon._follow_groups).
        self.checked = GroupWatch(_PER_STEP)
        # The captured step's key: what it reads of the groups, as of ``checked.edits``.
        self._key: tuple[Any, ...] = ()
        self._key_edits = -1
        self._staged_edits = -1  # ``checked.edits`` at the agreement's last stage
        # The step this one replaces, until a step shows every rank rebuilt alike: a rank
        # whose rebuilt plan the others do not share runs the previous one's collectives.
        self.previous: StepRunner | None = None
        self.rank = comm.rank
        named = list(named_params(groups))
        self.names = [name for name, _, _ in named]
        self.params = [p for _, _, p in named]
        self.grads = GradReader(self.names, self.params)
        self.storage = storage(self.params)  # where the bound views point (rebind.py)
        self.device = local(self.params[0]).device
        group_index = {id(g): i for i, g in enumerate(groups)}
        self._group_of = [group_index[id(group)] for _, group, _ in named]
        entries, self.muon_positions = muon_entries(groups)
        self.agreement = Agreement(
            self.names,
            self.muon_positions,
            self.device,
            comm.holders,
            groups,
            [i for i, p in enumerate(self.params) if _held_whole(p, comm.holders.size)],
            _PER_STEP,
            settings.backend,
        )
        self.inputs = StepInputs.allocate(
            len(groups), self._group_of, self.agreement.stage_size, self.device
        )
        # The mode of a step run whole at step(), and of one started from gradient hooks.
        self.modes = StepMode.pair(settings.nonfinite)
        self.muon = self._muon_phase(entries, state, settings, len(groups), comm)
        # overlap="backward" (or "auto", in its overlapped steps): the Muon phase's buckets
        # start from gradient hooks.
        self.early = (
            BackwardStart(
                self.muon,
                [self.names[i] for i in self.muon_positions],
                self.muon.programs[self.modes[1]],
            )
            if self.muon is not None and settings.starts_in_backward
            else None
        )
        self._muon_index = {id(self.params[i]): j for j, i in enumerate(self.muon_positions)}
        # Per AdamW group, its parameters' positions.
        members: dict[int, list[int]] = {}
        for position, (_, group, _) in enumerate(named):
            if group["algorithm"] == "adamw":
                members.setdefault(group_index[id(group)], []).append(position)
        self.adamw = AdamWPhase(members, self.params, self.inputs, self.agreement)
        self.graph = StepGraph(settings.graph_warmup) if settings.cuda_graph else None
        self.bind_state(state)

    def stale(self, groups: Sequence[dict[str, Any]]) -> str | None:
        """Why this step no longer fits ``groups``, or None: an option read when the step is
        built changed (:mod:`muon_dist.step.changes`), or a parameter got new storage since
        the step was built (:mod:`muon_dist.state.rebind`)."""
        replanned = self.built.replanned(groups)
        if replanned is not None:
            return replanned
        return self.moved()

    def moved(self) -> str | None:
        """Why this step no longer fits its parameters (one got new storage since the step
        was built), or None."""
        if storage(self.params) != self.storage:
            return "parameter storage changed"
        return None

    def replacing(self, previous: StepRunner) -> None:
        """This step replaces ``previous`` (or what ``previous`` still replaces), until the
        ranks agree on it."""
        self.previous = previous.previous or previous

    def _muon_phase(
        self,
        entries: Sequence[MuonEntry],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        group_count: int,
        comm: CommGroups,
    ) -> MuonPhase | None:
        """The plan of the Muon parameters, bound to their tensors (None without any)."""
        if not entries:
            return None
        placements = [
            placement_of(e.param, e.name, e.view, comm.holders.ranks, stack_recipe(e.group, e.view))
            for e in entries
        ]
        plan = build_plan(
            placements,
            comm.rank,
            comm.world_size,
            bucket_bytes=settings.bucket_bytes,
            itemsize=settings.comm_dtype.itemsize,
            replica_mode=settings.replica_mode,
            steps=[e.group["ns_steps"] for e in entries],
            backward_order=settings.starts_in_backward,
            shares=[_travelling_share(e.group, settings, comm.exchange.size) for e in entries],
        )
        logger.debug("muon_dist: built a plan with %d buckets", len(plan.buckets))
        return MuonPhase(
            bind(plan, entries, state, settings, group_count, comm, self.agreement, self.inputs)
        )

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the state tensors (again after a state load, which replaces them)."""
        self.adamw.bind_state(state)
        if self.muon is not None:
            self.muon.bind_state(state)
        if self.graph is not None:
            self.graph.reset()

    def grad_ready(self, p: torch.Tensor) -> None:
        """A Muon parameter's gradient is final (its post-accumulate-grad hook, in a step
        that overlaps backward): start the buckets that now can, of the step the ranks
        agreed on. A gradient this rank refuses starts nothing here; ``step()`` raises it,
        agreed with the other ranks."""
        if self.previous is not None:
            self.previous.grad_ready(p)
            return
        if self.early is None:
            return
        j = self._muon_index[id(p)]
        try:
            grad = self.grads.one(self.muon_positions[j])
        except (TypeError, ValueError, RuntimeError):
            return
        if grad is not None:
            self.early.report(j, grad)

    def run(
        self,
        groups: Sequence[dict[str, Any]],
        refusal: Exception | None = None,
        *,
        overlap: bool,
    ) -> Exception | None:
        """Queue one step. A rank that refuses its inputs (``refusal``: options or a closure
        that raised; a gradient of the wrong layout or a sparse one) still takes part in the
        step's agreement, with every gradient absent and its failure flagged, so every rank
        leaves everything as it was and learns of the failure; it returns its error for the
        caller to raise. A captured step where some parameter has no gradient runs eagerly
        (:meth:`muon_dist.step.launch.cuda_graph.StepGraph.uncaptured`). ``overlap``: this step's
        buckets started from gradient hooks (:meth:`grad_ready`), else it is the plain step
        (the same on every rank, :mod:`muon_dist.step.launch.overlap_choice`): the step's
        mode (:class:`StepMode`), whose program the Muon phase runs.
        """
        mode = self.modes[1] if overlap else self.modes[0]
        failure = refusal
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        present, fresh = [False] * len(self.params), True
        if failure is None:
            try:
                grads, present, fresh = self.grads.read()
            except (TypeError, ValueError, RuntimeError) as exc:
                failure = exc
                grads, present = [None] * len(self.params), [False] * len(self.params)
        compared: list[float] = []
        if failure is None:
            # The groups hold what the last step staged, the per-step keys aside.
            unchanged = self._staged_edits == self.checked.edits
            compared = self.agreement.stage(groups, self.rank, unchanged)
            self._staged_edits = self.checked.edits
        self.inputs.stage(groups, present, None if failure is None else self.rank, compared)
        if failure is not None:
            with self.built.restored():
                self._body(groups, grads, mode, failure)
        elif self.graph is None or self.previous is not None:
            self._body(groups, grads, mode)
        elif not all(present):
            self.graph.uncaptured(
                lambda: self._body(groups, grads, mode),
                [n for n, here in zip(self.names, present, strict=True) if not here],
            )
        else:
            if self._key_edits != self.checked.edits:
                self._key = tuple(
                    (k, repr(v)) for g in groups for k, v in g.items() if k not in _NOT_CAPTURED
                )
                self._key_edits = self.checked.edits
            every = cast(list[torch.Tensor], grads)  # all present
            self.graph.run(lambda: self._body(groups, every, mode), self._key, every, fresh)
        self.inputs.mirror.mark()  # the step that copies the staged values is queued
        return failure or self.crash()

    def mirror(self, muon_grads: Sequence[torch.Tensor | None], mode: StepMode) -> None:
        """Run this step's Muon collectives in ``mode``, keeping nothing: a rank whose
        rebuilt plan the other ranks do not share joins theirs, and the step fails on every
        rank."""
        self.agreement.refuse_all()
        self._muon_phase_of_step(muon_grads, mode)

    def _redo(
        self,
        early: BackwardStart,
        muon_grads: Sequence[torch.Tensor | None],
        refusal: Exception | None,
    ) -> torch.Tensor | None:
        """This rank's ask that every rank start the buckets the hooks started again: what
        they read changed (:meth:`BackwardStart.changed`), this rank refused the step (they
        read the values it refused), or they are the replaced step's, which this rank drops
        while the other ranks, not rebuilt, would finish theirs."""
        replaced = None if self.previous is None else self.previous.early
        if refusal is not None or (replaced is not None and replaced.started):
            return torch.ones((), device=self.device)
        return early.changed(muon_grads)

    def abandon(self) -> None:
        """Drop the buckets this step started from hooks: a rebuilt step replaces it."""
        if self.early is not None:
            self.early.abandon()

    def queued(self, step: int, failure: Exception | None) -> bool:
        """The step just run is ``step``: its outcome's host copy is queued, or dropped where
        it failed (``failure`` is raised instead). Whether that copy is already on the host
        (CPU), to be read at once."""
        report = self.agreement.report
        report.queued(step)
        if failure is not None:
            report.discard()
        return report.on_host

    def outcome(self) -> Outcome | None:
        """The last queued step's outcome, read once (on CUDA, waiting for that step)."""
        return self.agreement.report.read()

    @property
    def found_inf(self) -> torch.Tensor:
        """1.0 on the device where the last step kept nothing."""
        return self.agreement.found_inf

    def crash(self) -> Exception | None:
        """The exception this rank's own Muon work raised in the step just queued."""
        return None if self.muon is None else self.muon.error

    def _body(
        self,
        groups: Sequence[dict[str, Any]],
        grads: Sequence[torch.Tensor | None],
        mode: StepMode,
        refusal: Exception | None = None,
    ) -> None:
        """The device work of one step of ``mode``: everything a captured step replays. A
        rank that refused the step (``refusal``) runs the collectives only (its groups may
        be what it refused)."""
        self.inputs.mirror.send()  # a captured step's graph copies them at every replay
        muon_grads = [grads[i] for i in self.muon_positions]
        early = self.early if mode.early else None
        asks = None if early is None else self._redo(early, muon_grads, refusal)
        self.agreement.decide(grads, self.inputs, redo=asks)
        # A rank asked that every rank start the buckets the hooks started again.
        runner = self.previous if self.previous is not None and self._mirrors() else self
        if early is not None and self.agreement.redo_asked() and runner.early is not None:
            runner.early.redo()
        if runner is not self:
            runner.mirror(muon_grads, mode)
            self.agreement.publish()
            return
        self._muon_phase_of_step(muon_grads, mode)
        if refusal is None:
            self.adamw.run(groups, grads)
        self.agreement.publish()

    def _mirrors(self) -> bool:
        """Whether this step joins the previous plan's collectives: the ranks' options
        differed (read on the host, only while a previous plan is kept); once they agree,
        the previous plan is dropped."""
        if self.previous is None:
            return False
        if self.agreement.ranks_differ():
            return True
        self.previous.abandon()
        self.previous = None
        return False

    def _muon_phase_of_step(
        self, muon_grads: Sequence[torch.Tensor | None], mode: StepMode
    ) -> None:
        """The Muon phase after the agreement: finished from what the hooks started where
        the step is early, else run whole, after dropping what an overlapped step left open
        (its hooks ran, its ``step()`` raised before this point: ``overlap="auto"``
        switches modes between steps)."""
        if mode.early and self.early is not None:
            self.early.finish(muon_grads)
        elif self.muon is not None:
            self.abandon()
            self.muon.programs[self.modes[0]].run(muon_grads)


def _held_whole(p: torch.Tensor, holders: int) -> bool:
    """Whether each of the ``holders`` ranks holds all of ``p`` (a plain replica, or a
    DTensor replicated on every dim of a mesh over all of them): its gradients must then
    agree across ranks."""
    if not isinstance(p, DTensor):
        return True
    whole = all(isinstance(x, Replicate) for x in p.placements)
    return whole and p.device_mesh.size() == holders
