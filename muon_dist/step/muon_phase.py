"""The Muon phase of a step, bound once to a plan: one order for every step.

agree (by the caller) → scalars (:mod:`muon_dist.step.scalars`) → [momentum, Magma,
decay] (:mod:`muon_dist.state.muon_state`) → buckets (:mod:`muon_dist.step.bucket_task`:
Newton–Schulz input read by :mod:`muon_dist.step.piece_io`, gather, orthogonalize here,
scatter, update written by :mod:`muon_dist.step.piece_io`). A transactional step
(``nonfinite="skip_step"``) holds the bracketed state updates and the weight updates in a
:class:`SkipTransaction` until all ranks agree that every Newton–Schulz result is finite;
fusion changes which kernel runs a stage, never the order.

Everything a step repeats is decided when the plan is bound: the local shards, the bucket
maps, the device scalars, which pieces take the fused form. A steady-state step then only
launches work: it builds no plan, reads no device value and makes new views only of its
fresh buffers, a few per run of like pieces.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from muon_dist.dist.groups import CommGroups, Peers, dedicated
from muon_dist.kernels.dispatch import newton_schulz
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap, LocalSlices, StackSpec, bucket_map
from muon_dist.plan.build import (
    Plan,
    covers_exactly,
    local_boxes,
    local_pieces,
    local_rows,
    mesh_coords,
    placement_of,
)
from muon_dist.plan.selection import BucketSelection
from muon_dist.plan.views import Box, MatrixView
from muon_dist.rules.forms import fused_form
from muon_dist.rules.normuon import ROW_MOMENT
from muon_dist.rules.ops import decay_, mask_stack_
from muon_dist.rules.registry import RULES, rule_of
from muon_dist.rules.slices import selected_orthogonalize
from muon_dist.runtime import Task, run_tasks
from muon_dist.state.muon_state import MuonState
from muon_dist.state.row_moments import row_moments
from muon_dist.state.tensors import local
from muon_dist.step.agreement import Agreement
from muon_dist.step.bucket_task import bucket_task
from muon_dist.step.piece_io import LocalGrads, PieceForms, PieceIO
from muon_dist.step.scalars import MuonScalars, StepInputs
from muon_dist.step.selected_bucket import DeviceSelection, selected_bucket_task


@dataclass(frozen=True)
class MuonEntry:
    """One matrix view of a Muon parameter, in plan order.

    A parameter cut by ``split_sizes`` has one entry per row block; its matrices are
    numbered across its views from ``first_matrix`` on (Magma keeps one score per matrix).
    ``param_index`` is the parameter's position among the Muon parameters, ``group_index``
    its group's position among all groups.
    """

    param: torch.Tensor
    group: dict[str, Any]
    view: MatrixView
    name: str
    first_matrix: int
    param_index: int
    group_index: int


def _row_matrices(entries: Sequence[MuonEntry], comm: CommGroups) -> torch.Tensor:
    """For each dim-0 row of this rank's shard, which of the parameter's matrices it is in
    (``entries`` are all the views of one parameter)."""
    first = entries[0]
    placement = placement_of(first.param, first.name, first.view, comm.holders.ranks)
    lo, hi = local_rows(placement, comm.rank)
    rows = torch.arange(lo, hi)
    matrices = torch.zeros_like(rows)
    for e in entries:
        start, stop = e.view.box(0, e.view.count)[0]
        inside = (rows >= start) & (rows < stop)
        matrices[inside] = e.first_matrix + (rows[inside] - start) // e.view.dim0_step
    return matrices.to(local(first.param).device)


def _primary_owner(entry: MuonEntry, comm: CommGroups, replica_mode: str) -> bool:
    """Whether the matrices of a view this rank owns are their primary copies: always, but
    under ``replica_mode="redundant"``, where each replica has an owner, only in the first
    replica (coordinate 0 on every replicated mesh dim)."""
    if replica_mode != "redundant":
        return True
    placement = placement_of(entry.param, entry.name, entry.view, comm.holders.ranks)
    coord = mesh_coords(placement).get(comm.rank)
    replicated = [d for d, tensor_dim in enumerate(placement.shard_dims) if tensor_dim is None]
    return coord is not None and all(coord[d] == 0 for d in replicated)


def _bucket_maps(plan: Plan, peers: Peers) -> list[BucketMap]:
    """Every bucket's map, stacks numbered across the plan."""
    maps: list[BucketMap] = []
    for bucket in plan.buckets:
        first = sum(len(m.stacks) for m in maps)
        maps.append(bucket_map(bucket, first, plan.world_size, peers.ranks))
    return maps


def _fusable(
    plan: Plan,
    views_of: Sequence[Sequence[int]],
    groups: Sequence[dict[str, Any]],
    shards: Sequence[torch.Tensor],
) -> tuple[frozenset[int], frozenset[int]]:
    """Pieces whose local shard the step reads (writes) exactly once, so the read can
    also advance the momentum and the write also decay, in one pass.

    Magma needs the advanced momentum before any read and scales rows by a tensor;
    cautious decay needs the update's sign: both keep their separate passes.
    """
    reads, writes = local_pieces(plan)
    fusable_reads: set[int] = set()
    fusable_writes: set[int] = set()
    for j, views in enumerate(views_of):
        group, shape = groups[j], shards[j].shape
        if group["magma"]:
            continue
        if covers_exactly(shape, [piece for i in views for piece in reads[i]]):
            fusable_reads.update(views)
        if not group["cautious_wd"] and covers_exactly(
            shape, [piece for i in views for piece in writes[i]]
        ):
            fusable_writes.update(views)
    return frozenset(fusable_reads), frozenset(fusable_writes)


def _fused(
    fusable: frozenset[int],
    tensor_of: Sequence[int],
    shards: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    backend: str,
) -> frozenset[int]:
    """The fusable pieces whose tensors take the fused form under the backend."""
    return frozenset(
        i for i in fusable if fused_form(backend, shards[tensor_of[i]], momenta[tensor_of[i]])
    )


class SkipTransaction:
    """A transactional step's writes, held until every rank knows each result is finite."""

    def __init__(self) -> None:
        self._held: list[tuple[Sequence[LocalSlices], Sequence[torch.Tensor]]] | None = None

    @property
    def open(self) -> bool:
        return self._held is not None

    def begin(self) -> None:
        self._held = []

    def hold(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        cast(list[tuple[Sequence[LocalSlices], Sequence[torch.Tensor]]], self._held).append(
            (pieces, updates)
        )

    def held_bytes(self) -> int:
        """Bytes of the storages the held updates keep alive."""
        storages = {
            update.untyped_storage().data_ptr(): update.untyped_storage().nbytes()
            for _, updates in self._held or []
            for update in updates
        }
        return sum(storages.values())

    def end(self) -> tuple[tuple[LocalSlices, ...], list[torch.Tensor], Hashable]:
        """The held pieces and updates as one write, and a key naming them across steps."""
        held, self._held = self._held or [], None
        return (
            tuple(piece for pieces, _ in held for piece in pieces),
            [update for _, updates in held for update in updates],
            tuple(id(pieces) for pieces, _ in held),
        )


class MuonPhase:
    """The Muon phase of every step for one plan; the bucket tasks' context."""

    # Long for a constructor: it wires the phase's parts from one plan (state, gradients,
    # NorMuon moments, scalars, piece I/O, result flags), each built by its own module.
    def __init__(
        self,
        plan: Plan,
        entries: Sequence[MuonEntry],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        group_count: int,
        comm: CommGroups,
        agreement: Agreement,
    ) -> None:
        self.plan = plan
        self.peers = comm.exchange  # this rank's bucket all-to-alls
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.settings = settings
        self.backend = settings.backend
        self.comm_dtype = settings.comm_dtype
        self.agreement = agreement
        # The first exception this rank's own work (Newton–Schulz, a read or a write of an
        # update) raised in the last run, agreed with the other ranks through the result
        # flags instead of leaving them in a collective.
        self.error: Exception | None = None
        self.entries = list(entries)
        self.params = list({id(e.param): e.param for e in entries}.values())
        self.shards = [local(p) for p in self.params]
        self.device = self.shards[0].device
        self._views_of: list[list[int]] = [[] for _ in self.params]
        for index, e in enumerate(entries):
            self._views_of[e.param_index].append(index)
        self.groups = [entries[views[0]].group for views in self._views_of]
        self._group_of = [entries[views[0]].group_index for views in self._views_of]
        self.maps = _bucket_maps(plan, self.peers)
        self.state = MuonState(
            self.params,
            self.groups,
            {
                j: _row_matrices([entries[i] for i in self._views_of[j]], comm)
                for j, g in enumerate(self.groups)
                if g["magma"]
            },
            comm.holders,
        )
        self.grads = LocalGrads(self.shards, self.state)
        self.state.bind(state, self._momenta(state))
        # NorMuon's per-row second moments; their all-reduce runs among the holders.
        self.row_moments = row_moments(
            [e.view for e in entries],
            [_primary_owner(e, comm, settings.replica_mode) for e in entries],
            self._views_of,
            self.groups,
            [(b, m.stacks) for b, m in zip(plan.buckets, self.maps, strict=True)],
            comm.holders,
            self.device,
            settings.backend,
        )
        self.row_moments.bind(self._moment_tensors(state))
        # Per matrix of every stack, its tensor, and the sum of its result (finite exactly
        # when the result is), so a step tests and flags every result at once instead of
        # once per stack.
        sizes = [stack.shape[0] for m in self.maps for stack in m.stacks]
        stack_tensor = [
            entries[i].param_index for m in self.maps for s in m.stacks for i in s.views
        ]
        self.fusable_reads, self.fusable_writes = _fusable(
            plan, self._views_of, self.groups, self.shards
        )
        self.scalars, forms = _scalars_and_forms(self, group_count, stack_tensor)
        self.io = PieceIO(
            forms, self.shards, self.state, self.grads, self.scalars, settings.backend
        )
        self.transaction = SkipTransaction()
        self._stack_tensor = torch.tensor(stack_tensor, dtype=torch.long, device=self.device)
        self._tensors_of_stack = self._stack_tensor.split_with_sizes(sizes)
        self._result_sums = torch.zeros(len(stack_tensor), device=self.device)
        self._sums_of_stack = self._result_sums.split_with_sizes(sizes)
        self._dropped_of_stack = self.scalars.dropped.split_with_sizes(sizes)
        # Between open_early and the end of close_early: a step begun from gradient hooks
        # (muon_dist.step.backward), whose held updates must not pin their stacks.
        self.early = False
        self._comm = comm
        # Dion2's views (fraction, parts), and the buckets where only selected slices
        # travel: those that exchange, unless the step is captured (its sizes are fixed).
        self._selects = {
            i: (float(e.group["dion2_fraction"]), e.view.part_split(e.group["adjust_lr"]))
            for i, e in enumerate(entries)
            if rule_of(e.group).selects_slices
        }
        self.selected = frozenset(
            index
            for index, bucket in enumerate(plan.buckets)
            if bucket.communicates
            and not settings.cuda_graph
            and any(b.view in self._selects and b.owner in self.peers.ranks for b in bucket.blocks)
        )
        self._selections: dict[int, DeviceSelection] = {}
        # Dion2's norms and choice run ahead of the buckets' Newton–Schulz: on a stream of
        # their own, their all-reduce on a communicator of its own (neither waits behind
        # the all-to-alls), so a bucket's host copy of its choice waits for nothing else.
        self.norm_peers = dedicated(self.peers, "dion2 norms") if self.selected else self.peers
        self.selection_stream: torch.cuda.Stream | None = None
        if self.selected and self.device.type == "cuda":
            self.selection_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    # -- plan time ----------------------------------------------------------------------

    def _momenta(self, state: dict[torch.Tensor, dict[str, Any]]) -> list[torch.Tensor]:
        return [local(state[p]["momentum_buffer"]) for p in self.params]

    def _moment_tensors(self, state: dict[torch.Tensor, dict[str, Any]]) -> dict[int, torch.Tensor]:
        return {j: state[self.params[j]][ROW_MOMENT] for j in self.row_moments.spans}

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the momentum buffers, Magma scores and NorMuon moments (again after a
        state load)."""
        self.state.bind(state, self._momenta(state))
        self.row_moments.bind(self._moment_tensors(state))
        self.io.bind()

    # -- the step -----------------------------------------------------------------------

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """This step's local gradients (None where absent), read by the bucket tasks."""
        if self.grads.set(grads):
            self.io.forget_writes()

    def bucket(self, index: int) -> Task:
        """Bucket ``index``'s task, in plan order."""
        if index in self.selected:
            return selected_bucket_task(
                self.plan.buckets[index], self.maps[index], lambda: self._selection(index), self
            )
        return bucket_task(self.plan.buckets[index], self.maps[index], self)

    def _selection(self, index: int) -> DeviceSelection:
        """Bucket ``index``'s Dion2 layout, laid out on its first step."""
        found = self._selections.get(index)
        if found is None:
            found = self._selections[index] = DeviceSelection(
                BucketSelection(
                    self.plan.buckets[index],
                    self.rank,
                    self.peers.ranks,
                    [e.view for e in self.entries],
                    self._selects,
                    self._local_box,
                    self.maps[index].stacks,
                ),
                self.device,
            )
        return found

    def _local_box(self, view: int) -> Box:
        e = self.entries[view]
        placement = placement_of(e.param, e.name, e.view, self._comm.holders.ranks)
        return local_boxes(placement)[self.rank]

    def run(
        self, grads: Sequence[torch.Tensor | None], inputs: StepInputs, *, transactional: bool
    ) -> None:
        """One Muon phase on the local gradients ``grads`` (None where absent), after the
        agreement decided on them; ``transactional`` holds every write and state update
        until the ranks agree that each Newton–Schulz result is finite."""
        self.error = None
        self.set_grads(grads)
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=True)
        if transactional:
            self.transaction.begin()
        else:
            self._advance_state(store_all=False)
        self.row_moments.start()
        run_tasks(
            (self.bucket(i) for i in range(len(self.plan.buckets))), self.settings.max_inflight
        )
        self._agree_on_results(torch.isfinite(self._result_sums), transactional)
        if transactional:
            self._commit(inputs)
        self.row_moments.finish(self.scalars.keep_of)

    def open_early(self) -> None:
        """Open a step whose buckets start before the agreement (``overlap="backward"``): no
        matrix is dropped before Newton–Schulz (which ones is not known yet), and every
        write and state update waits in the transaction for :meth:`close_early`."""
        self.error = None
        self.agreement.clear_results()
        self.scalars.dropped.zero_()
        self.transaction.begin()
        self.row_moments.start()
        self.early = True

    def close_early(self, inputs: StepInputs, *, transactional: bool) -> None:
        """Close a step opened by :meth:`open_early` once all its buckets ran, after the
        agreement on the gradients: agree on the results of the matrices kept and commit
        the held writes and state updates where kept. Under ``transactional`` a non-finite
        result skips the step, as in :meth:`run`."""
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=True)
        finite = torch.isfinite(self._result_sums).logical_or_(self.scalars.dropped)
        self._agree_on_results(finite, transactional)
        self.early = False
        self._commit(inputs)
        self.row_moments.finish(self.scalars.keep_of)

    def _agree_on_results(self, finite: torch.Tensor, transactional: bool) -> None:
        """Flag every matrix whose result is not ``finite`` (a scratch mask, negated in place)
        and agree with the other ranks."""
        self.agreement.count_bad_results(self._stack_tensor, finite.logical_not_().float())
        self.agreement.agree_on_results(transactional)

    def _commit(self, inputs: StepInputs) -> None:
        """Apply the held writes and state updates where the agreement keeps them."""
        pieces, updates, key = self.transaction.end()
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=False)
        self._advance_state(store_all=True)
        self.io.write(pieces, updates, key=key, unchecked=True)

    def _advance_state(self, store_all: bool) -> None:
        """Momentum (one foreach pass per coefficient; with ``store_all`` also of the
        tensors whose fused read advances it otherwise), Magma and the unfused decay."""
        scalars, grads, fused_reads = self.scalars, self.grads, self.io.forms.fused_reads
        by_beta: dict[float, list[int]] = {}
        for j, group in enumerate(self.groups):
            if store_all or self._views_of[j][0] not in fused_reads:
                by_beta.setdefault(rule_of(group).momentum_carry(group), []).append(j)
        self.state.advance_momenta(by_beta, grads.tensors, grads.local, scalars.ok, scalars.keep_of)
        if self.state.magma:
            for j, damping in self.state.advance_magma(grads.tensors, scalars.keep_of).items():
                shape = (-1, *[1] * (self.shards[j].ndim - 1))
                for i in self._views_of[j]:
                    scalars.magma_step_of[i] = (damping * scalars.step_of[i]).view(shape)
        self._decay()

    def _decay(self) -> None:
        """Tensors with a local gradient decay by their group's factor, one launch per
        group; the others by their own, which depends on the other ranks' gradients."""
        by_group: dict[int, list[int]] = {}
        alone: list[int] = []
        for j, group in enumerate(self.groups):
            if group["cautious_wd"] or self._views_of[j][0] in self.io.forms.fused_writes:
                continue
            if self.grads.local[j]:
                by_group.setdefault(self._group_of[j], []).append(j)
            else:
                alone.append(j)
        for g, members in by_group.items():
            decay_([self.shards[j] for j in members], self.scalars.group_decay_of[g])
        if alone:
            decay_([self.shards[j] for j in alone], [self.scalars.decay_of[j] for j in alone])

    # -- the bucket tasks' context ------------------------------------------------------

    def read_updates(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        try:
            self.io.read(pieces, outs, store=not self.transaction.open)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            # Zero inputs orthogonalize to zero: the stack stays finite, the write a no-op.
            torch._foreach_zero_(list(outs))
            self._fail(exc, [self.entries[index].param_index for index, _ in pieces])

    def orthogonalize(
        self, stack: torch.Tensor, spec: StackSpec, chosen: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        mask_stack_(stack, self._dropped_of_stack[spec.index], self.settings.backend)
        recipe = spec.recipe
        if recipe is None:
            raise RuntimeError(f"muon_dist: stack {spec.index} has no recipe; this is a bug")
        rows = self.row_moments.stacks.get(spec.index)
        selected = recipe.rule if RULES[recipe.rule.name].selects_slices else None

        def orthogonalize(x: torch.Tensor) -> torch.Tensor:
            # Dion2's stacks, a quarter of the slices, replay from graphs whatever their
            # size: launching their Newton–Schulz cost the host more than the GPU's work.
            return newton_schulz(
                x,
                steps=recipe.steps,
                coefficients=recipe.coefficients,
                dtype=self.settings.ns_dtype,
                backend=self.settings.backend,
                method=recipe.method,
                graphed=selected is not None,
            )

        def run(x: torch.Tensor, part: int | None = None) -> torch.Tensor:
            if selected is not None:
                assert selected.transposed is not None and selected.fraction is not None
                # A part is handed over by output rows, whatever the storage.
                transposed = selected.transposed and part is None
                index = None if chosen is None else chosen[part or 0]
                return selected_orthogonalize(
                    x, orthogonalize, selected.fraction, transposed, self.settings.backend, index
                )
            result = orthogonalize(x)
            return result if rows is None else self.row_moments.normalize(result, rows, part)

        try:
            result = run(stack) if recipe.parts is None else recipe.parts.orthogonalize(stack, run)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            self._fail(exc, self._tensors_of_stack[spec.index])
            self._sums_of_stack[spec.index].zero_()
            return stack.new_zeros(stack.shape, dtype=self.settings.ns_dtype)
        # One sum per matrix instead of an elementwise test: a sum is finite exactly when
        # every entry is, since Newton–Schulz entries are O(1) and cannot overflow it.
        torch.sum(result, dim=(-2, -1), dtype=torch.float32, out=self._sums_of_stack[spec.index])
        return result

    def apply(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        try:
            if self.settings.ns_dtype != self.comm_dtype:
                # Owners add their own result in the dtype the other holders receive it in,
                # so replicas of a parameter round identically and stay bitwise equal. Piece
                # by piece: a cast of whole stacks would hold both dtypes' stacks at once.
                updates = [update.to(self.comm_dtype) for update in updates]
            elif self.early:
                # Held from backward to step(): copies of this rank's pieces only, so the
                # bucket's whole stacks and exchange buffers are freed meanwhile.
                updates = [update.clone() for update in updates]
            if self.transaction.open:
                self.transaction.hold(pieces, updates)
                return
            self.io.write(pieces, updates)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            self._fail(exc, [self.entries[index].param_index for index, _ in pieces])

    def _fail(self, exc: Exception, tensors: torch.Tensor | Sequence[int]) -> None:
        """Record an exception of this rank's own work on ``tensors`` in the agreement's
        result flags; the first one is raised on this rank after the step."""
        self.error = self.error or exc
        if not isinstance(tensors, torch.Tensor):
            tensors = torch.tensor(list(tensors), dtype=torch.long, device=self.device)
        self.agreement.record_failure(self.rank, tensors)


def _scalars_and_forms(
    phase: MuonPhase, group_count: int, stack_tensor: list[int]
) -> tuple[MuonScalars, PieceForms]:
    """A phase's device scalars, and each piece's tensor, group, step class and forms
    (plan time, from its entries, groups and fusable pieces)."""
    entries = phase.entries
    classes: dict[tuple[int, float], int] = {}
    scales = [e.view.lr_scale(e.group["adjust_lr"]) for e in entries]
    class_of = tuple(
        classes.setdefault((e.group_index, scale), len(classes))
        for e, scale in zip(entries, scales, strict=True)
    )
    scalars = MuonScalars(
        group_of=phase._group_of,
        cautious=[g["cautious_wd"] for g in phase.groups],
        piece_tensor=[e.param_index for e in entries],
        neg_scale=[-scale for scale in scales],
        class_group=[g for g, _ in classes],
        class_neg_scale=[-scale for _, scale in classes],
        stack_tensor=stack_tensor,
        group_count=group_count,
        device=phase.device,
    )
    tensor_of = [e.param_index for e in entries]
    backend, momenta = phase.settings.backend, phase.state.momenta
    fused_reads = _fused(phase.fusable_reads, tensor_of, phase.shards, momenta, backend)
    fused_writes = _fused(phase.fusable_writes, tensor_of, phase.shards, momenta, backend)
    plain = frozenset(
        i
        for i, e in enumerate(entries)
        if i not in fused_writes and not e.group["cautious_wd"] and not e.group["magma"]
    )
    forms = PieceForms(
        tensor_of=tuple(tensor_of),
        group_of=tuple(e.group_index for e in entries),
        groups=tuple(e.group for e in entries),
        class_of=class_of,
        fused_reads=fused_reads,
        fused_writes=fused_writes,
        plain_writes=plain,
    )
    return scalars, forms
