"""The Muon phase of a step, bound once to a plan: one order for every step.

agree (by the caller) → scalars (:mod:`muon_dist.step.shard.scalars`) → [momentum, Magma,
decay] (:mod:`muon_dist.state.muon_state`) → buckets (:mod:`muon_dist.step.bucket.bucket_task`:
Newton–Schulz input read by :mod:`muon_dist.step.shard.piece_io`, gather, orthogonalize here,
scatter, update written by :mod:`muon_dist.step.shard.piece_io`). A transactional step
(``nonfinite="skip_step"``) holds the bracketed state updates and the weight updates in a
:class:`SkipTransaction` until all ranks agree that every Newton–Schulz result is finite;
fusion changes which kernel runs a stage, never the order.

Everything a step repeats is decided when the plan is bound: the local shards, the bucket
maps, the device scalars, which pieces take the fused form. A steady-state step then only
launches work: it builds no plan, reads no device value and makes new views only of its
fresh buffers, a few per run of like pieces.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from muon_dist.comm.exchange import Exchanges
from muon_dist.comm.groups import CommGroups, Peers
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap, StackSpec, bucket_map
from muon_dist.plan.build import Plan, covers_exactly, local_pieces
from muon_dist.plan.indices import TensorIndex
from muon_dist.plan.recipes import StackRecipe
from muon_dist.rules.forms import fused_form
from muon_dist.rules.ops import decay_
from muon_dist.rules.registry import rule_of
from muon_dist.runtime import Task, run_tasks
from muon_dist.state.muon_state import MuonState
from muon_dist.state.tensors import local
from muon_dist.step.agree.agreement import Agreement
from muon_dist.step.agree.failures import Failures
from muon_dist.step.bucket.bucket_io import BucketIO, BucketTools
from muon_dist.step.bucket.bucket_task import bucket_task
from muon_dist.step.bucket.orthogonalizer import Orthogonalizer
from muon_dist.step.shard.entries import MuonEntry, row_matrices
from muon_dist.step.shard.piece_io import LocalGrads, PieceForms, PieceIO
from muon_dist.step.shard.scalars import MuonScalars, StepInputs
from muon_dist.step.shard.shard_io import format_shard_io_table, shard_io
from muon_dist.step.shard.transaction import SkipTransaction
from muon_dist.step.wings.base import Wing, WingSite
from muon_dist.step.wings.registry import wing_of


def _bind_wings(site: WingSite) -> dict[str, Wing]:
    """One wing per wing class the groups' rules declare, over the views of those rules,
    bound in plan order; keyed by each rule's name, as a stack's recipe names it."""
    views: dict[type[Wing], set[int]] = {}
    rules: dict[str, type[Wing]] = {}
    for i, e in enumerate(site.entries):
        rule = rule_of(e.group)
        kind = rules.setdefault(rule.name, wing_of(rule))
        views.setdefault(kind, set()).add(i)
    wings = {kind: kind(site, frozenset(members)) for kind, members in views.items()}
    return {name: wings[kind] for name, kind in rules.items()}


def _bucket_maps(plan: Plan, peers: Peers, packed: Collection[int]) -> list[BucketMap]:
    """Every bucket's map, stacks numbered across the plan; the buckets ``packed`` (moved by
    a wing's exchange, as Dion2's, which packs only the chosen slices) never use a buffer
    as stacks."""
    maps: list[BucketMap] = []
    for index, bucket in enumerate(plan.buckets):
        first = sum(len(m.stacks) for m in maps)
        rank = None if index in packed else plan.rank
        maps.append(bucket_map(bucket, first, plan.world_size, peers.ranks, rank))
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


def _recipe(spec: StackSpec) -> StackRecipe:
    if spec.recipe is None:
        raise RuntimeError(f"muon_dist: stack {spec.index} has no recipe; this is a bug")
    return spec.recipe


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


class MuonPhase:
    """The Muon phase of every step for one plan: it binds the state, scalars and piece
    I/O to the plan, and hands the bucket tasks what they work with (:class:`BucketTools`)."""

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
        self.settings = settings
        self.agreement = agreement
        self.entries = list(entries)
        self.params = list({id(e.param): e.param for e in entries}.values())
        self.shards = [local(p) for p in self.params]
        self.device = self.shards[0].device
        self.views_of: list[list[int]] = [[] for _ in self.params]
        for index, e in enumerate(entries):
            self.views_of[e.tensor_index].append(index)
        self.groups = [entries[views[0]].group for views in self.views_of]
        self._group_of = [entries[views[0]].group_index for views in self.views_of]
        exchanges = Exchanges(comm.exchange, settings.comm_dtype, self.device, comm.world_size)
        site = WingSite(plan, self.entries, self.views_of, comm, exchanges, settings, self.device)
        self.wings = _bind_wings(site)
        bound = list({id(w): w for w in self.wings.values()}.values())
        packed = frozenset(i for w in bound for i in w.packed)
        self.maps = _bucket_maps(plan, exchanges.peers, packed)
        for wing in bound:
            wing.lay_out(self.maps)
        self._bound = bound
        self._make_state(state, comm)
        self._make_step(group_count, comm, exchanges)

    def _make_state(self, state: dict[torch.Tensor, dict[str, Any]], comm: CommGroups) -> None:
        """The momenta and Magma scores, the local gradients, the wings' state."""
        entries = self.entries
        magma_rows = {
            j: row_matrices([entries[i] for i in views], comm)
            for j, views in enumerate(self.views_of)
            if self.groups[j]["magma"]
        }
        self.state = MuonState(self.params, self.groups, magma_rows, comm.holders)
        self.grads = LocalGrads(self.shards, self.state)
        self.state.bind(state, self._momenta(state))
        for wing in self._bound:
            wing.bind_state(state)

    def _make_step(
        self,
        group_count: int,
        comm: CommGroups,
        exchanges: Exchanges,
    ) -> None:
        """The device scalars and the bucket tasks' collaborators."""
        entries, settings, plan, agreement = self.entries, self.settings, self.plan, self.agreement
        # Per matrix of every stack, in plan order, its Muon tensor.
        stacks = [stack for m in self.maps for stack in m.stacks]
        stack_tensor = [entries[i].tensor_index for stack in stacks for i in stack.views]
        self.fusable_reads, self.fusable_writes = _fusable(
            plan, self.views_of, self.groups, self.shards
        )
        self.scalars, forms = _scalars_and_forms(self, group_count, stack_tensor)
        self.transaction = SkipTransaction()
        self.failures = Failures(agreement, comm.rank, [e.tensor_index for e in entries])
        self.pieces = PieceIO(
            forms, self.shards, self.state, self.grads, self.scalars, settings.backend
        )
        self.io = BucketIO(self.pieces, self.transaction, self.failures, settings)
        wings = self.wings
        self.orthogonalizer = Orthogonalizer(
            settings,
            lambda spec: wings[_recipe(spec).rule.name].owner(spec),
            self.failures,
            stack_tensor,
            [stack.shape[0] for stack in stacks],
            self.scalars.dropped,
        )
        self.tools = BucketTools(exchanges, self.io, self.orthogonalizer)

    @property
    def error(self) -> Exception | None:
        """The first exception this rank's own work raised in the last run (raised by
        ``step()`` once the other ranks know, through the result flags)."""
        return self.failures.error

    def shard_io_table(self) -> str:
        """Where each view's shard read, write, momentum, decay and Dion2's feedback
        happen, as printable text (:mod:`muon_dist.step.shard.shard_io`)."""
        return format_shard_io_table(self.pieces.forms.io)

    # -- plan time ----------------------------------------------------------------------

    def _momenta(self, state: dict[torch.Tensor, dict[str, Any]]) -> list[torch.Tensor]:
        return [local(state[p]["momentum_buffer"]) for p in self.params]

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the momentum buffers, Magma scores and the wings' state tensors (again
        after a state load)."""
        self.state.bind(state, self._momenta(state))
        for wing in self._bound:
            wing.bind_state(state)
        self.pieces.bind()

    # -- the step -----------------------------------------------------------------------

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """This step's local gradients (None where absent), read by the bucket tasks."""
        if self.grads.set(grads):
            self.pieces.forget_writes()

    def bucket(self, index: int) -> Task:
        """Bucket ``index``'s task, in plan order."""
        bucket, where = self.plan.buckets[index], self.maps[index]
        exchanges = (w.exchange(index, where) for w in self._bound)
        exchange = next((x for x in exchanges if x is not None), None)
        return bucket_task(bucket, where, self.tools, exchange)

    def run(
        self, grads: Sequence[torch.Tensor | None], inputs: StepInputs, *, transactional: bool
    ) -> None:
        """One Muon phase on the local gradients ``grads`` (None where absent), after the
        agreement decided on them; ``transactional`` holds every write and state update
        until the ranks agree that each Newton–Schulz result is finite."""
        self.failures.reset()
        self.set_grads(grads)
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=True)
        if transactional:
            self.transaction.begin()
        else:
            self._advance_state(store_all=False)
        self._start_wings()
        run_tasks(
            (self.bucket(i) for i in range(len(self.plan.buckets))), self.settings.max_inflight
        )
        self._agree_on_results(self.orthogonalizer.finite(), transactional)
        if transactional:
            self._commit(inputs)
        self._finish_wings()

    def open_early(self) -> None:
        """Open a step whose buckets start before the agreement (``overlap="backward"``): no
        matrix is dropped before Newton–Schulz (which ones is not known yet), and every
        write and state update waits in the transaction for :meth:`close_early`."""
        self.failures.reset()
        self.agreement.clear_results()
        self.scalars.dropped.zero_()
        self.transaction.begin()
        self._start_wings()
        self.io.early = True

    def close_early(self, inputs: StepInputs, *, transactional: bool) -> None:
        """Close a step opened by :meth:`open_early` once all its buckets ran, after the
        agreement on the gradients: agree on the results of the matrices kept and commit
        the held writes and state updates where kept. Under ``transactional`` a non-finite
        result skips the step, as in :meth:`run`."""
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=True)
        finite = self.orthogonalizer.finite().logical_or_(self.scalars.dropped)
        self._agree_on_results(finite, transactional)
        self.io.early = False
        self._commit(inputs)
        self._finish_wings()

    def _start_wings(self) -> None:
        for wing in self._bound:
            wing.start()

    def _finish_wings(self) -> None:
        for wing in self._bound:
            wing.finish(self.scalars.keep_of)

    def _agree_on_results(self, finite: torch.Tensor, transactional: bool) -> None:
        """Flag every matrix whose result is not ``finite`` (a scratch mask, negated in place)
        and agree with the other ranks."""
        bad = finite.logical_not_().float()
        self.agreement.count_bad_results(self.orthogonalizer.stack_tensor, bad)
        self.agreement.agree_on_results(transactional)

    def _commit(self, inputs: StepInputs) -> None:
        """Apply the held writes and state updates where the agreement keeps them."""
        pieces, updates, key = self.transaction.end()
        self.scalars.stage(self.agreement.keep, self.agreement.found_inf, inputs, drop=False)
        self._advance_state(store_all=True)
        self.pieces.write(pieces, updates, key=key, unchecked=True)

    def _advance_state(self, store_all: bool) -> None:
        """Momentum (one foreach pass per coefficient; with ``store_all`` also of the
        tensors whose fused read advances it otherwise), Magma and the unfused decay."""
        scalars, grads, io = self.scalars, self.grads, self.pieces.forms.io
        by_beta: dict[float, list[int]] = {}
        for j, group in enumerate(self.groups):
            if store_all or not io[self.views_of[j][0]].fused_read:
                by_beta.setdefault(rule_of(group).momentum_carry(group), []).append(j)
        self.state.advance_momenta(by_beta, grads.tensors, grads.local, scalars.ok, scalars.keep_of)
        if self.state.magma:
            for j, damping in self.state.advance_magma(grads.tensors, scalars.keep_of).items():
                shape = (-1, *[1] * (self.shards[j].ndim - 1))
                for i in self.views_of[j]:
                    scalars.magma_step_of[i] = (damping * scalars.step_of[i]).view(shape)
        self._decay()

    def _decay(self) -> None:
        """Tensors with a local gradient decay by their group's factor, one launch per
        group; the others by their own, which depends on the other ranks' gradients."""
        by_group: dict[int, list[int]] = {}
        alone: list[int] = []
        for j, views in enumerate(self.views_of):
            if not self.pieces.forms.io[views[0]].decays_tensor:
                continue
            if self.grads.local[j]:
                by_group.setdefault(self._group_of[j], []).append(j)
            else:
                alone.append(j)
        for g, members in by_group.items():
            decay_([self.shards[j] for j in members], self.scalars.group_decay_of[g])
        if alone:
            decay_([self.shards[j] for j in alone], [self.scalars.decay_of[j] for j in alone])


def _scalars_and_forms(
    phase: MuonPhase, group_count: int, stack_tensor: Sequence[TensorIndex]
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
        piece_tensor=[e.tensor_index for e in entries],
        neg_scale=[-scale for scale in scales],
        class_group=[g for g, _ in classes],
        class_neg_scale=[-scale for _, scale in classes],
        stack_tensor=stack_tensor,
        group_count=group_count,
        device=phase.device,
    )
    tensor_of = [e.tensor_index for e in entries]
    write_parts = [phase.wings[rule_of(e.group).name].write_part() for e in entries]
    backend, momenta = phase.settings.backend, phase.state.momenta
    fused_reads = _fused(phase.fusable_reads, tensor_of, phase.shards, momenta, backend)
    fused_writes = _fused(phase.fusable_writes, tensor_of, phase.shards, momenta, backend)
    forms = PieceForms(
        tensor_of=tuple(tensor_of),
        group_of=tuple(e.group_index for e in entries),
        groups=tuple(e.group for e in entries),
        class_of=class_of,
        write_parts=tuple(write_parts),
        io=tuple(
            shard_io(
                e.view.label(e.name),
                fused_read=i in fused_reads,
                fused_write=i in fused_writes,
                cautious=bool(e.group["cautious_wd"]),
                magma=bool(e.group["magma"]),
                feedback=write_parts[i] is not None,
            )
            for i, e in enumerate(entries)
        ),
    )
    return scalars, forms
