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
from muon_dist.plan.packing import shape_runs
from muon_dist.rules.ops import (
    nesterov_mix,
    ns_inputs_,
    pre_orthogonalize_,
)
from muon_dist.rules.registry import rule_of
from muon_dist.state.muon_state import MuonState
from muon_dist.step.shard.piece_writes import (
    Batch,
    BatchedWrite,
    Feedback,
    FusedWrite,
    SingleWrite,
    Write,
    WritePart,
)
from muon_dist.step.shard.scalars import MuonScalars
from muon_dist.step.shard.shard_io import (
    DECAY_CAUTIOUS,
    WRITE_FUSED,
    WRITE_SINGLE,
    ShardIO,
)


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
class PieceForms:
    """Per piece (plan view index): its tensor, group, step class, and where its shard I/O
    happens (:mod:`muon_dist.step.shard.shard_io`, decided at bind time)."""

    tensor_of: tuple[int, ...]
    group_of: tuple[int, ...]
    groups: tuple[dict[str, Any], ...]  # per piece
    class_of: tuple[int, ...]
    io: tuple[ShardIO, ...]
    write_parts: tuple[WritePart | None, ...]  # the rule's wing's


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
        # How each of the bucket maps' piece tuples is read and written, decided on its
        # first step; writes depend on which tensors have a local gradient, so they are
        # decided again when that changes (:meth:`forget_writes`).
        self._reads: dict[tuple[int, bool], _Reads] = {}
        self._writes: dict[Hashable, tuple[Write, ...]] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self) -> None:
        """Forget the views of momenta and the writes holding them (after a state load,
        which replaces them)."""
        self._views = {}
        self._writes.clear()

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
            fused = self.forms.io[index].fused_read
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
        """Write updates, each piece in the form its record names (:class:`FusedWrite`,
        :class:`BatchedWrite`, :class:`SingleWrite`). ``unchecked`` updates (a
        transactional step's) may be non-finite where ``keep`` is false, and a zero step
        does not cancel them: each form selects them away. ``key`` names ``pieces`` across
        steps (by default the tuple itself, one of the maps')."""
        key = id(pieces) if key is None else key
        writes = self._writes.get(key)
        if writes is None:
            writes = self._writes[key] = self._plan_writes(pieces)
        for batch in writes:
            batch.write(updates, self._scalars, unchecked)

    def _plan_writes(self, pieces: Sequence[LocalSlices]) -> tuple[Write, ...]:
        """The tuple's writes: its fused pieces in one batch, its batched pieces per step
        class and dtype (tensors with a local gradient) or in one batch (without), each
        single piece alone. Which tensors have a local gradient may change between steps:
        :meth:`forget_writes` makes them planned again."""
        forms, scalars = self.forms, self._scalars
        fused: list[int] = []
        own: list[int] = []
        singles: list[Write] = []
        classes: dict[int, dict[torch.dtype, list[int]]] = {}
        for i, (index, slices) in enumerate(pieces):
            write, j = forms.io[index].write, forms.tensor_of[index]
            if write == WRITE_FUSED:
                fused.append(i)
            elif write == WRITE_SINGLE:
                singles.append(
                    SingleWrite(
                        i,
                        index,
                        slices[0],
                        self._pieces(index, slices)[0],
                        scalars.step_of[index],
                        scalars.keep_of[j],
                        scalars.cautious_of[j] if forms.io[index].decay == DECAY_CAUTIOUS else None,
                        self._feedback(index, slices),
                    )
                )
            elif self._grads.local[j]:
                dtype = self._pieces(index, slices)[0].dtype
                classes.setdefault(forms.class_of[index], {}).setdefault(dtype, []).append(i)
            else:
                own.append(i)
        writes: list[Write] = []
        if fused:
            writes.append(
                FusedWrite(
                    self._batch(pieces, fused),
                    tuple(scalars.decay_of[forms.tensor_of[pieces[i][0]]] for i in fused),
                    tuple(scalars.step_of[pieces[i][0]] for i in fused),
                )
            )
        writes += singles
        if own:
            writes.append(
                BatchedWrite(
                    self._batch(pieces, own),
                    self._backend,
                    steps=tuple(scalars.step_of[pieces[i][0]] for i in own),
                )
            )
        for cls, by_dtype in classes.items():
            for dtype, positions in by_dtype.items():
                batch = self._batch(pieces, positions)
                writes.append(
                    BatchedWrite(
                        batch,
                        self._backend,
                        shared=cls,
                        dtype=dtype,
                        runs=shape_runs(tuple(t.shape) for t in batch.targets),
                    )
                )
        return tuple(writes)

    def _batch(self, pieces: Sequence[LocalSlices], positions: Sequence[int]) -> Batch:
        return Batch(
            tuple(positions),
            tuple(self._pieces(*pieces[i])[0] for i in positions),
            tuple(self._scalars.keep_of[self.forms.tensor_of[pieces[i][0]]] for i in positions),
            tuple(self._feedback(*pieces[i]) for i in positions),
        )

    def _feedback(self, index: int, slices: Slices) -> Feedback | None:
        """The feedback of a piece whose rule has a write part (Dion2's)."""
        part = self.forms.write_parts[index]
        if part is None:
            return None
        return part.of_piece(self._pieces(index, slices)[1], self.forms.groups[index])
