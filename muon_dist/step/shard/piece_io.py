"""Reading Newton–Schulz inputs from, and writing updates to, pieces of local shards.

A bucket reads and writes pieces in tuples laid out once per plan
(:mod:`muon_dist.plan.bucket_map`); how each tuple is read in a step mode and written
(which pieces share a launch, in which form of :mod:`muon_dist.rules.ops`) is compiled on
its first step into batches (:mod:`muon_dist.step.shard.piece_reads`,
:mod:`muon_dist.step.shard.piece_writes`) and kept, as are the views of parameters, momenta
and gradients the pieces need, so a steady-state step makes no new view of them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.plan.bucket_map import LocalSlices
from muon_dist.plan.build import Slices, is_whole
from muon_dist.plan.packing import shape_runs
from muon_dist.state.muon_state import MuonState
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.piece_reads import (
    AdvancingRead,
    GradPiece,
    LocalGrads,
    MixingRead,
    Read,
)
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
    FEEDBACK_NONE,
    MOMENTUM_BEFORE,
    MOMENTUM_IN_READ,
    WRITE_FUSED,
    WRITE_SINGLE,
    ShardIO,
    format_shard_io_table,
)
from muon_dist.step.shard.transaction import Held


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

    def table(self) -> str:
        """The records as printable text, one row per view."""
        return format_shard_io_table(self.io)


class PieceIO:
    """Reads and writes of local-shard pieces, compiled per tuple of pieces; the momenta
    and Magma scores (``state``) and this step's gradients (``grads``) they read."""

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
        self.state = state
        self.grads = grads
        self._backend = backend  # the optimizer's: whether Dion2's error feedback fuses
        self._shards = list(shards)
        self._scalars = scalars
        # How each of the bucket maps' piece tuples is read (per mode) and written, decided
        # on its first step; writes depend on which tensors have a local gradient, so they
        # are decided again when that changes (:meth:`forget_writes`).
        self._reads: dict[tuple[int, StepMode], tuple[Read, ...]] = {}
        self._writes: dict[Hashable, tuple[Write, ...]] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self) -> None:
        """Forget the views of momenta and the reads and writes holding them (after a state
        load, which replaces them)."""
        self._views = {}
        self._reads.clear()
        self._writes.clear()

    def forget_writes(self) -> None:
        self._writes.clear()

    def _pieces(self, index: int, slices: Slices) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameter and momentum views of a piece, made once per plan."""
        key = (index, id(slices))
        views = self._views.get(key)
        if views is None:
            j = self.forms.tensor_of[index]
            momentum = self.state.momenta[j]
            views = self._views[key] = (self._shards[j][slices], momentum[slices])
        return views

    # -- reads ----------------------------------------------------------------------------

    def read(
        self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor], mode: StepMode
    ) -> None:
        """Write each piece's Newton–Schulz input into its ``out``, in a step of ``mode``."""
        key = (id(pieces), mode)
        reads = self._reads.get(key)
        if reads is None:
            reads = self._reads[key] = self._plan_reads(pieces, mode)
        for batch in reads:
            batch.read(self.grads, outs)

    def _plan_reads(self, pieces: Sequence[LocalSlices], mode: StepMode) -> tuple[Read, ...]:
        """One batch per place of the momentum (its record's for ``mode``), form and group:
        advanced and stored in the read, advanced before (mixed only), or advanced in the
        read and stored at the commit."""
        forms = self.forms
        batches: dict[tuple[str, bool, int], list[int]] = {}
        for i, (index, _) in enumerate(pieces):
            record = forms.io[index]
            key = (record.momentum_at(mode), record.fused_read, forms.group_of[index])
            batches.setdefault(key, []).append(i)
        reads: list[Read] = []
        for (place, fused, _), positions in batches.items():
            chosen = [pieces[i] for i in positions]
            grads = tuple(self._grad_piece(v, s) for v, s in chosen)
            momenta = tuple(self._pieces(v, s)[1] for v, s in chosen)
            group = forms.groups[chosen[0][0]]
            if place == MOMENTUM_BEFORE:
                reads.append(MixingRead(tuple(positions), grads, momenta, group))
                continue
            keeps = tuple(self._scalars.keep_of[forms.tensor_of[v]] for v, _ in chosen)
            store = place == MOMENTUM_IN_READ
            reads.append(
                AdvancingRead(tuple(positions), grads, momenta, keeps, group, fused, store)
            )
        return tuple(reads)

    def _grad_piece(self, index: int, slices: Slices) -> GradPiece:
        """How the read takes piece ``index``'s gradient: whole where the piece is its local
        shard (a gradient lies like its parameter), else by its slices."""
        j = self.forms.tensor_of[index]
        return (j, (index, id(slices)), None if is_whole(slices, self._shards[j].shape) else slices)

    # -- writes ---------------------------------------------------------------------------

    def write(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        """Write updates, each piece in the form its record names (:class:`FusedWrite`,
        :class:`BatchedWrite`, :class:`SingleWrite`). ``pieces`` is one of the maps'
        tuples, the same object every step."""
        writes = self._writes.get(id(pieces))
        if writes is None:
            writes = self._writes[id(pieces)] = self._plan_writes(pieces)
        for batch in writes:
            batch.write(updates, self._scalars)

    def commit(self, held: Held) -> None:
        """Write a transaction's held updates, which may be non-finite where ``keep`` is
        false, and which a zero step does not cancel: each form selects them away."""
        writes = self._writes.get(held.key)
        if writes is None:
            planned = self._plan_writes(held.pieces)
            writes = self._writes[held.key] = tuple(w.of_held() for w in planned)
        for batch in writes:
            batch.write(held.updates, self._scalars)

    def _plan_writes(self, pieces: Sequence[LocalSlices]) -> tuple[Write, ...]:
        """The tuple's writes: its fused pieces in one batch, its batched pieces per step
        class and dtype (tensors with a local gradient) or in one batch (without), each
        single piece alone. Which tensors have a local gradient may change between steps:
        :meth:`forget_writes` makes them planned again."""
        forms, scalars = self.forms, self._scalars
        fused, own, singles, classes = self._sort_writes(pieces)
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

    def _sort_writes(
        self, pieces: Sequence[LocalSlices]
    ) -> tuple[list[int], list[int], list[Write], dict[int, dict[torch.dtype, list[int]]]]:
        """The tuple's positions by form: fused; batched without a local gradient; each
        single piece's write; batched with one, per step class and dtype."""
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
            elif self.grads.local[j]:
                dtype = self._pieces(index, slices)[0].dtype
                classes.setdefault(forms.class_of[index], {}).setdefault(dtype, []).append(i)
            else:
                own.append(i)
        return fused, own, singles, classes

    def _batch(self, pieces: Sequence[LocalSlices], positions: Sequence[int]) -> Batch:
        return Batch(
            tuple(positions),
            tuple(self._pieces(*pieces[i])[0] for i in positions),
            tuple(self._scalars.keep_of[self.forms.tensor_of[pieces[i][0]]] for i in positions),
            tuple(self._feedback(*pieces[i]) for i in positions),
        )

    def _feedback(self, index: int, slices: Slices) -> Feedback | None:
        """The piece's feedback where its record has one (the rule's write part's, Dion2's);
        the record's write form says where it runs (in the fused write, or beside)."""
        if self.forms.io[index].feedback == FEEDBACK_NONE:
            return None
        part = self.forms.write_parts[index]
        assert part is not None  # shard_io() records feedback only where there is a part
        return part.of_piece(self._pieces(index, slices)[1], self.forms.groups[index])
