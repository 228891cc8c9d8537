"""Reading Newton–Schulz inputs from, and writing updates to, pieces of local shards.

A bucket reads and writes pieces in tuples laid out once per plan
(:mod:`muon_dist.plan.bucket_map`); how each tuple is batched (which pieces share a launch, in
which form of :mod:`muon_dist.rules.ops`) is decided on its first step and kept, as are
the views of parameters, momenta and gradients the pieces need, so a steady-state step
makes no new view of them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.plan.bucket_map import LocalSlices
from muon_dist.plan.build import Slices, is_whole
from muon_dist.plan.packing import Runs, flat_views, runs_numel, shape_runs
from muon_dist.rules.ops import (
    drop_unkept,
    error_feedback_,
    fused_updates_,
    nesterov_mix,
    ns_inputs_,
    post_orthogonalize_,
    pre_orthogonalize_,
    shared_step_updates_,
    updates_,
)
from muon_dist.rules.registry import rule_of
from muon_dist.state.muon_state import MuonState
from muon_dist.step.scalars import MuonScalars


class LocalGrads:
    """This step's local gradients of the Muon tensors (zeros where absent); the views of
    a gradient's pieces are kept while the gradient tensor stays the same."""

    def __init__(self, shards: Sequence[torch.Tensor], state: MuonState) -> None:
        self._shards = list(shards)
        self._state = state
        # Empty until a step sets them (:meth:`set`, or :meth:`set_one` from a hook).
        self.tensors: list[torch.Tensor] = [shard.new_empty(0) for shard in self._shards]
        self.local: list[bool] = [True] * len(self._shards)  # has a local gradient
        self._sources: list[torch.Tensor | None] = [None] * len(self._shards)
        self._views: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in self._shards]

    def set(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Take this step's gradients; returns whether which tensors have one changed."""
        local = [grad is not None for grad in grads]
        changed = local != self.local
        self.local = local
        for j, grad in enumerate(grads):
            self.set_one(j, grad)
        return changed

    def set_one(self, j: int, grad: torch.Tensor | None) -> None:
        """Take tensor j's gradient (None: absent, read as zeros)."""
        if grad is None:
            grad = torch.zeros_like(self._shards[j])
        if grad is not self._sources[j]:
            self._sources[j] = grad
            self._views[j] = {}
            self._state.forget_grad(j)
        self.tensors[j] = grad

    def piece(self, j: int, key: tuple[int, int], slices: Slices) -> torch.Tensor:
        view = self._views[j].get(key)
        if view is None:
            grad = self.tensors[j]
            view = self._views[j][key] = grad if is_whole(slices, grad.shape) else grad[slices]
        return view


@dataclass(frozen=True)
class _Reads:
    """How one tuple of pieces is read: positions batched per form and group (fused,
    group) where the momentum advances in the read, and per group where it advanced
    before. Groups, not their coefficients: a scheduler may change ``momentum`` between
    steps, so each step reads β and the Nesterov mix from the group."""

    advancing: tuple[tuple[tuple[bool, dict[str, Any]], tuple[int, ...]], ...]
    advanced: tuple[tuple[dict[str, Any], tuple[int, ...]], ...]


@dataclass(frozen=True)
class _ClassWrites:
    """Plain pieces of one step class and parameter dtype, written with shared launches;
    their scaled updates lie in one flat buffer in ``runs``."""

    step_class: int
    dtype: torch.dtype
    positions: tuple[int, ...]
    targets: tuple[torch.Tensor, ...]
    runs: Runs


@dataclass(frozen=True)
class _Writes:
    """How one tuple of pieces is written (see :meth:`PieceIO.write`); ``masked`` are the
    positions whose unchecked updates are selected one by one."""

    masked: tuple[int, ...]
    feedback: tuple[int, ...]  # Dion2's pieces whose error feedback is not in their write
    fused: tuple[int, ...]  # fused writes with one step and no cautious decay: one launch
    alone: tuple[int, ...]
    loose: tuple[int, ...]
    loose_targets: tuple[torch.Tensor, ...]
    loose_steps: tuple[torch.Tensor, ...]
    classes: tuple[_ClassWrites, ...]


@dataclass(frozen=True)
class PieceForms:
    """Per piece (plan view index): its tensor, group, step class, and which pieces take
    the fused form in reads and in writes, and which write a plain ``param += step·update``
    (their decay ran over the whole tensor before)."""

    tensor_of: tuple[int, ...]
    group_of: tuple[int, ...]
    groups: tuple[dict[str, Any], ...]  # per piece
    class_of: tuple[int, ...]
    fused_reads: frozenset[int]
    fused_writes: frozenset[int]
    plain_writes: frozenset[int]


class PieceIO:
    """Reads and writes of local-shard pieces, batched per tuple of pieces."""

    def __init__(
        self,
        forms: PieceForms,
        shards: Sequence[torch.Tensor],
        state: MuonState,
        grads: LocalGrads,
        scalars: MuonScalars,
        backend: str,
    ) -> None:
        self.forms = forms
        self._backend = backend  # the optimizer's: whether Dion2's error feedback fuses
        self._shards = list(shards)
        self._state = state
        self._grads = grads
        self._scalars = scalars
        self._cautious = [g["cautious_wd"] for g in forms.groups]
        # How each of the bucket maps' piece tuples is read and written, decided on its
        # first step; writes depend on which tensors have a local gradient, so they are
        # decided again when that changes (:meth:`forget_writes`).
        self._reads: dict[tuple[int, bool], _Reads] = {}
        self._writes: dict[Hashable, _Writes] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self) -> None:
        """Forget the views of momenta (after a state load, which replaces them)."""
        self._views = {}

    def forget_writes(self) -> None:
        self._writes.clear()

    def _pieces(self, index: int, slices: Slices) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameter and momentum views of a piece, made once per plan."""
        key = (index, id(slices))
        views = self._views.get(key)
        if views is None:
            j = self.forms.tensor_of[index]
            momentum = self._state.momenta[j]
            views = self._views[key] = (self._shards[j][slices], momentum[slices])
        return views

    def _grad(self, index: int, slices: Slices) -> torch.Tensor:
        return self._grads.piece(self.forms.tensor_of[index], (index, id(slices)), slices)

    # -- reads ----------------------------------------------------------------------------

    def read(
        self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor], *, store: bool
    ) -> None:
        """Write each piece's Newton–Schulz input into its ``out``. Where the momentum did
        not advance before, it advances here, and is stored only when ``store`` (a step
        that may still be skipped reads the next momentum without keeping it)."""
        key = (id(pieces), store)
        reads = self._reads.get(key)
        if reads is None:
            reads = self._reads[key] = self._plan_reads(pieces, store)
        keep_of = self._scalars.keep_of
        for (fused, group), positions in reads.advancing:
            pre_orthogonalize_(
                [self._grad(*pieces[i]) for i in positions],
                [self._pieces(*pieces[i])[1] for i in positions],
                [outs[i] for i in positions],
                beta=rule_of(group).momentum_carry(group),
                mix=nesterov_mix(group["momentum"], group["nesterov"]),
                keeps=[keep_of[self.forms.tensor_of[pieces[i][0]]] for i in positions],
                store=store,
                fused=fused,
            )
        for group, positions in reads.advanced:
            ns_inputs_(
                [self._grad(*pieces[i]) for i in positions],
                [self._pieces(*pieces[i])[1] for i in positions],
                [outs[i] for i in positions],
                nesterov_mix(group["momentum"], group["nesterov"]),
            )

    def _plan_reads(self, pieces: Sequence[LocalSlices], store: bool) -> _Reads:
        """One batch per form and group: pieces whose momentum advances here (fused, or a
        transactional step's read) and pieces whose momentum advanced before, which only
        need the Nesterov mix and the cast to ``out``."""
        advancing: dict[tuple[bool, int], list[int]] = {}
        advanced: dict[int, list[int]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for i, (index, _) in enumerate(pieces):
            g = self.forms.group_of[index]
            groups[g] = self.forms.groups[index]
            fused = index in self.forms.fused_reads
            if not store or fused:
                advancing.setdefault((fused, g), []).append(i)
            else:
                advanced.setdefault(g, []).append(i)
        return _Reads(
            tuple(((f, groups[g]), tuple(positions)) for (f, g), positions in advancing.items()),
            tuple((groups[g], tuple(positions)) for g, positions in advanced.items()),
        )

    # -- writes ---------------------------------------------------------------------------

    def write(
        self,
        pieces: Sequence[LocalSlices],
        updates: Sequence[torch.Tensor],
        key: Hashable = None,
        unchecked: bool = False,
    ) -> None:
        """Write updates; plain pieces (torch form, no Magma or cautious decay) batched.

        A plain piece of a tensor with a local gradient has the step of its class (group
        and lr scale), so each class takes three multi-tensor launches: cast the updates to
        the parameters' dtype, scale them, add them. Other plain pieces take one foreach
        ``addcmul`` with their own steps; the rest go one by one. ``unchecked`` updates (a
        transactional step's) may be non-finite where ``keep`` is false, and a zero step
        does not cancel them: they are selected away, for a class in one pass over its
        scaled updates, since its tensors are kept exactly when the step is. ``key``
        names ``pieces`` across steps (by default the tuple itself, one of the maps').
        """
        key = id(pieces) if key is None else key
        writes = self._writes.get(key)
        if writes is None:
            writes = self._writes[key] = self._plan_writes(pieces)
        scalars = self._scalars
        if unchecked:
            updates = list(updates)
            for i in writes.masked:
                j = self.forms.tensor_of[pieces[i][0]]
                updates[i] = drop_unkept(updates[i], scalars.keep_of[j])
        for i in writes.feedback:
            index, slices = pieces[i]
            error_feedback_(
                self._pieces(index, slices)[1],
                updates[i],
                self.forms.groups[index]["momentum"],
                scalars.keep_of[self.forms.tensor_of[index]],
                self._backend,
            )
        if writes.fused:
            self._write_fused([pieces[i] for i in writes.fused], [updates[i] for i in writes.fused])
        for i in writes.alone:
            self._write_one(*pieces[i], updates[i])
        if writes.loose:
            updates_(writes.loose_targets, [updates[i] for i in writes.loose], writes.loose_steps)
        for cls in writes.classes:
            device = cls.targets[0].device
            scratch = torch.empty(runs_numel(cls.runs), dtype=cls.dtype, device=device)
            shared_step_updates_(
                cls.targets,
                [updates[i] for i in cls.positions],
                scalars.class_step_of[cls.step_class],
                scratch,
                flat_views(scratch, cls.runs),
                scalars.ok if unchecked else None,
            )

    def _plan_writes(self, pieces: Sequence[LocalSlices]) -> _Writes:
        forms = self.forms
        alone: list[int] = []
        loose: list[int] = []
        classes: dict[int, dict[torch.dtype, list[int]]] = {}
        for i, (index, slices) in enumerate(pieces):
            if index not in forms.plain_writes:
                alone.append(i)
            elif self._grads.local[forms.tensor_of[index]]:
                dtype = self._pieces(index, slices)[0].dtype
                classes.setdefault(forms.class_of[index], {}).setdefault(dtype, []).append(i)
            else:
                loose.append(i)
        targets = [self._pieces(*piece)[0] for piece in pieces]
        fused = [
            i
            for i in alone
            if pieces[i][0] in forms.fused_writes
            and not forms.groups[pieces[i][0]]["cautious_wd"]
            and not forms.groups[pieces[i][0]]["magma"]
        ]
        return _Writes(
            tuple(i for i in alone + loose if pieces[i][0] not in forms.fused_writes),
            tuple(
                i
                for i, (j, _) in enumerate(pieces)
                if rule_of(forms.groups[j]).selects_slices and i not in alone
            ),
            tuple(fused),
            tuple(i for i in alone if i not in fused),
            tuple(loose),
            tuple(targets[i] for i in loose),
            tuple(self._scalars.step_of[pieces[i][0]] for i in loose),
            tuple(
                _ClassWrites(
                    cls,
                    dtype,
                    tuple(positions),
                    tuple(targets[i] for i in positions),
                    shape_runs(tuple(targets[i].shape) for i in positions),
                )
                for cls, by_dtype in classes.items()
                for dtype, positions in by_dtype.items()
            ),
        )

    def _write_fused(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        """Fused writes with a one-element step and no cautious decay, in one launch."""
        scalars, forms = self._scalars, self.forms
        fused_updates_(
            [self._pieces(*piece)[0] for piece in pieces],
            updates,
            decays=[scalars.decay_of[forms.tensor_of[index]] for index, _ in pieces],
            steps=[scalars.step_of[index] for index, _ in pieces],
            keeps=[scalars.keep_of[forms.tensor_of[index]] for index, _ in pieces],
            feedbacks=[self._feedback(*piece) for piece in pieces],
        )

    def _feedback(self, index: int, slices: Slices) -> tuple[torch.Tensor, float] | None:
        """Dion2's error feedback of a piece written with its update: momentum and β."""
        group = self.forms.groups[index]
        if not rule_of(group).selects_slices:
            return None
        return self._pieces(index, slices)[1], group["momentum"]

    def _write_one(self, index: int, slices: Slices, update: torch.Tensor) -> None:
        j = self.forms.tensor_of[index]
        target, _ = self._pieces(index, slices)
        scalars = self._scalars
        magma_step = scalars.magma_step_of.get(index)
        step = magma_step[slices[0]] if magma_step is not None else scalars.step_of[index]
        fused = index in self.forms.fused_writes
        post_orthogonalize_(
            target,
            update,
            step=step,
            keep=scalars.keep_of[j],
            decay=scalars.decay_of[j] if fused else None,
            cautious=scalars.cautious_of[j] if self._cautious[index] else None,
            fused=fused,
            feedback=self._feedback(index, slices),
        )
