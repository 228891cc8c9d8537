"""The Muon phase bound to a plan: everything a step repeats, decided once.

The wings of the groups' rules (:mod:`muon_dist.step.wings`), the bucket maps, the state,
the device scalars, each view's shard I/O record (which pieces take the fused form), the
piece I/O, the owner's Newton–Schulz and, per step mode, what the bucket tasks work with.
A steady-state step then only launches work.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.comm.exchange import Exchanges
from muon_dist.comm.groups import CommGroups, Peers
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap, StackSpec, bucket_map
from muon_dist.plan.build import Plan, covers_exactly, local_pieces
from muon_dist.plan.indices import TensorIndex
from muon_dist.plan.recipes import StackRecipe
from muon_dist.rules.forms import fused_pieces
from muon_dist.rules.registry import rule_of
from muon_dist.state.muon_state import MuonState
from muon_dist.state.tensors import local
from muon_dist.step.agree.agreement import Agreement
from muon_dist.step.agree.failures import Failures
from muon_dist.step.bucket.bucket_io import BucketIO, BucketTools
from muon_dist.step.bucket.orthogonalizer import Orthogonalizer
from muon_dist.step.shard.entries import MuonEntry, MuonTensors, row_matrices
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.piece_io import PieceForms, PieceIO
from muon_dist.step.shard.piece_reads import LocalGrads
from muon_dist.step.shard.scalars import MuonScalars, StepInputs
from muon_dist.step.shard.shard_io import Fused, shard_io
from muon_dist.step.shard.transaction import SkipTransaction
from muon_dist.step.wings.base import Wing, WingSite
from muon_dist.step.wings.registry import wing_of


@dataclass(frozen=True)
class Bound:
    """A Muon phase's parts, bound to its plan: the plan, settings, agreement and staged
    host values (``inputs``) it was bound with; the tensors, bucket maps and wings (by rule
    name; ``unique_wings`` each once, in plan order), the device scalars, the piece I/O
    (with the state and gradients it reads), the owner's Newton–Schulz, where failures are
    flagged, the transaction, and per step mode what the bucket tasks work with."""

    plan: Plan
    settings: ExecutionSettings
    agreement: Agreement
    inputs: StepInputs
    tensors: MuonTensors
    maps: list[BucketMap]
    wings: dict[str, Wing]
    unique_wings: tuple[Wing, ...]
    scalars: MuonScalars
    pieces: PieceIO
    orthogonalizer: Orthogonalizer
    failures: Failures
    transaction: SkipTransaction
    tools: dict[StepMode, BucketTools]


def bind(
    plan: Plan,
    entries: Sequence[MuonEntry],
    state: dict[torch.Tensor, dict[str, Any]],
    settings: ExecutionSettings,
    group_count: int,
    comm: CommGroups,
    agreement: Agreement,
    inputs: StepInputs,
) -> Bound:
    """Bind a phase of ``plan`` (whose views are ``entries``) to its tensors and state."""
    tensors = MuonTensors.of(entries)
    exchanges = Exchanges(comm.exchange, settings.comm_dtype, tensors.device, comm.world_size)
    site = WingSite(
        plan, tensors.entries, tensors.views_of, comm, exchanges, settings, tensors.device
    )
    wings, unique, maps = _wings_and_maps(site)
    muon_state = _state(tensors, comm)
    bind_state(tensors, muon_state, unique, state)
    # Per matrix of every stack, in plan order, its Muon tensor.
    stacks = [stack for m in maps for stack in m.stacks]
    stack_tensor = [entries[i].tensor_index for stack in stacks for i in stack.views]
    scalars = _scalars(tensors, group_count, stack_tensor, settings.backend)
    forms = _forms(plan, tensors, wings, muon_state.momenta, settings.backend)
    grads = LocalGrads(tensors.shards, muon_state)
    pieces = PieceIO(forms, tensors.shards, muon_state, grads, scalars, settings.backend)
    failures = Failures(agreement, comm.rank, [e.tensor_index for e in entries])
    ortho = Orthogonalizer(
        settings,
        lambda spec: wings[_recipe(spec).rule.name].owner(spec),
        failures,
        stack_tensor,
        [stack.shape[0] for stack in stacks],
        scalars.dropped,
    )
    transaction = SkipTransaction()
    tools = {
        mode: BucketTools(exchanges, BucketIO(pieces, transaction, failures, settings, mode), ortho)
        for mode in StepMode
    }
    return Bound(
        plan,
        settings,
        agreement,
        inputs,
        tensors,
        maps,
        wings,
        unique,
        scalars,
        pieces,
        ortho,
        failures,
        transaction,
        tools,
    )


def _wings_and_maps(site: WingSite) -> tuple[dict[str, Wing], tuple[Wing, ...], list[BucketMap]]:
    """The wings (by rule name, and each once in plan order), and the bucket maps laid out
    for them: the buckets a wing's own exchange moves never use a buffer as stacks."""
    wings = _bind_wings(site)
    unique = tuple({id(w): w for w in wings.values()}.values())
    packed = frozenset(i for w in unique for i in w.packed)
    maps = _bucket_maps(site.plan, site.exchanges.peers, packed)
    for wing in unique:
        wing.lay_out(maps)
    return wings, unique, maps


def _state(tensors: MuonTensors, comm: CommGroups) -> MuonState:
    """The momenta and Magma scores (Magma's rows: which matrix each local row is in)."""
    magma_rows = {
        j: row_matrices([tensors.entries[i] for i in views], comm)
        for j, views in enumerate(tensors.views_of)
        if tensors.groups[j]["magma"]
    }
    return MuonState(tensors.params, tensors.groups, magma_rows, comm.holders)


def bind_state(
    tensors: MuonTensors,
    muon_state: MuonState,
    wings: Sequence[Wing],
    state: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """Point at the momentum buffers, Magma scores and the wings' state tensors (again
    after a state load)."""
    muon_state.bind(state, [local(state[p]["momentum_buffer"]) for p in tensors.params])
    for wing in wings:
        wing.bind_state(state)


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


def fusable(plan: Plan, tensors: MuonTensors) -> tuple[frozenset[int], frozenset[int]]:
    """Pieces whose local shard the step reads (writes) exactly once, so the read can
    also advance the momentum and the write also decay, in one pass.

    Magma needs the advanced momentum before any read and scales rows by a tensor;
    cautious decay needs the update's sign: both keep their separate passes.
    """
    reads, writes = local_pieces(plan)
    fusable_reads: set[int] = set()
    fusable_writes: set[int] = set()
    for j, views in enumerate(tensors.views_of):
        group, shape = tensors.groups[j], tensors.shards[j].shape
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
        i for i in fusable if fused_pieces(backend, shards[tensor_of[i]], momenta[tensor_of[i]])
    )


def _step_classes(
    entries: Sequence[MuonEntry],
) -> tuple[list[float], tuple[int, ...], list[tuple[int, float]]]:
    """Each view's lr scale and step class (its group and lr scale), and the classes."""
    classes: dict[tuple[int, float], int] = {}
    scales = [e.view.lr_scale(e.group["adjust_lr"]) for e in entries]
    class_of = tuple(
        classes.setdefault((e.group_index, scale), len(classes))
        for e, scale in zip(entries, scales, strict=True)
    )
    return scales, class_of, list(classes)


def _scalars(
    tensors: MuonTensors, group_count: int, stack_tensor: Sequence[TensorIndex], backend: str
) -> MuonScalars:
    """A phase's device scalars."""
    entries = tensors.entries
    scales, _, classes = _step_classes(entries)
    return MuonScalars(
        group_of=tensors.group_of,
        cautious=[g["cautious_wd"] for g in tensors.groups],
        piece_tensor=[e.tensor_index for e in entries],
        neg_scale=[-scale for scale in scales],
        class_group=[g for g, _ in classes],
        class_neg_scale=[-scale for _, scale in classes],
        stack_tensor=stack_tensor,
        group_count=group_count,
        device=tensors.device,
        backend=backend,
    )


def _forms(
    plan: Plan,
    tensors: MuonTensors,
    wings: dict[str, Wing],
    momenta: Sequence[torch.Tensor],
    backend: str,
) -> PieceForms:
    """Each piece's tensor, group, step class, write part and shard I/O record (which of
    its passes take the fused form: those of :func:`fusable` the backend fuses)."""
    entries = tensors.entries
    tensor_of = [e.tensor_index for e in entries]
    reads, writes = (
        _fused(pieces, tensor_of, tensors.shards, momenta, backend)
        for pieces in fusable(plan, tensors)
    )
    write_parts = [wings[rule_of(e.group).name].write_part() for e in entries]

    def fused(i: int) -> Fused:
        return (Fused.READ if i in reads else Fused.NONE) | (
            Fused.WRITE if i in writes else Fused.NONE
        )

    return PieceForms(
        tensor_of=tuple(tensor_of),
        group_of=tuple(e.group_index for e in entries),
        groups=tuple(e.group for e in entries),
        class_of=_step_classes(entries)[1],
        write_parts=tuple(write_parts),
        io=tuple(
            shard_io(e.view.label(e.name), fused(i), e.group, write_parts[i])
            for i, e in enumerate(entries)
        ),
    )
