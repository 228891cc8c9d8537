"""The Muon phase of a step, bound once to a plan and to the optimizer's tensors.

Everything a step repeats is decided here when the plan is built: the local shards, their
momentum buffers and the views of every piece a bucket reads or writes, which tensors take
the fused form of the update rule, the bucket layouts (stacks, and where each piece lies in
them and in the exchange buffers) and their device index tensors, and the device buffers
that hold this step's scalars; how each layout's pieces are read and written is decided on
their first step. A steady-state step then only launches work: it builds no plan, reads no
device value and makes new views only of its fresh buffers, a few per run of like pieces
(gradient views are kept while the gradient tensors stay the same; a whole shard serves as
its own view).

One order for every step: agree (by the caller) → scalars → [momentum, Magma, decay] →
buckets (Newton–Schulz input, gather, orthogonalize, scatter, update). A transactional step
(``nonfinite="skip_step"``) moves the bracketed state updates and the weight updates after
the point where all ranks agree that every Newton–Schulz result is finite; fusion changes
which kernel runs a stage, never the order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from muon_dist.comm import Runs, flat_views, runs_numel, shape_runs
from muon_dist.flat import Span, spans
from muon_dist.groups import CommGroups
from muon_dist.kernels.coefficients import Coefficients
from muon_dist.kernels.dispatch import newton_schulz
from muon_dist.plan import (
    Plan,
    covers_exactly,
    is_whole,
    layout_of,
    local,
    local_pieces,
    local_rows,
)
from muon_dist.routing import MatrixView, PartSplit
from muon_dist.runtime import run_tasks
from muon_dist.runtime.bucket_task import (
    BucketLayout,
    LocalSlices,
    StackLayout,
    bucket_layout,
    bucket_task,
)
from muon_dist.settings import ExecutionSettings
from muon_dist.update_rule import (
    fused_form,
    mask_stack_,
    ns_inputs_,
    post_orthogonalize_,
    pre_orthogonalize_,
    store_momenta_,
)

# Magma-lite: the update of a matrix is damped to MIN + (1 - MIN) * score, where the score is
# an EMA of (1 + cos(momentum, gradient)) / 2 over steps, started at 1 (no damping).
MAGMA_MIN_SCALE = 0.1
_MAGMA_EPS = 1e-12

Slices = tuple[slice, ...]


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


def ns_key(group: dict[str, Any], view: MatrixView) -> tuple[int, Hashable, PartSplit | None, str]:
    """What Newton–Schulz runs on a view's matrices besides the shape: steps, coefficients,
    the parts the owner cuts each matrix into (with their lr scales), and the method. Groups
    loaded from a checkpoint saved before ``ns_method`` existed lack the key: "auto", its
    default."""
    coefficients = group["coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(tuple(float(v) for v in t) for t in coefficients)
    parts = view.part_split(group["adjust_lr"])
    return (group["ns_steps"], coefficients, parts, group.get("ns_method", "auto"))


def _row_matrices(entries: Sequence[MuonEntry], comm: CommGroups) -> torch.Tensor:
    """For each dim-0 row of this rank's shard, which of the parameter's matrices it is in
    (``entries`` are all the views of one parameter)."""
    first = entries[0]
    layout = layout_of(first.param, first.name, first.view, comm.holders.ranks)
    lo, hi = local_rows(layout, comm.rank)
    rows = torch.arange(lo, hi)
    matrices = torch.zeros_like(rows)
    for e in entries:
        start, stop = e.view.box(0, e.view.count)[0]
        inside = (rows >= start) & (rows < stop)
        matrices[inside] = e.first_matrix + (rows[inside] - start) // e.view.dim0_step
    return matrices.to(local(first.param).device)


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

    step: int
    dtype: torch.dtype
    positions: tuple[int, ...]
    targets: tuple[torch.Tensor, ...]
    runs: Runs


@dataclass(frozen=True)
class _Writes:
    """How one tuple of pieces is written (see :meth:`MuonStep._write_all`); ``masked``
    are the positions whose unchecked updates are selected one by one."""

    masked: tuple[int, ...]
    alone: tuple[int, ...]
    loose: tuple[int, ...]
    loose_targets: tuple[torch.Tensor, ...]
    loose_steps: tuple[torch.Tensor, ...]
    classes: tuple[_ClassWrites, ...]


def _nesterov_mix(group: dict[str, Any]) -> float | None:
    """The weight of the momentum in Newton–Schulz's input ``g + mix·m``; None for ``m``."""
    return group["momentum"] if group["nesterov"] else None


class MuonStep:
    """The Muon phase of every step for one plan; implements the bucket tasks' context."""

    def __init__(
        self,
        plan: Plan,
        entries: Sequence[MuonEntry],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        group_count: int,
        comm: CommGroups,
    ) -> None:
        self.plan = plan
        self.peers = comm.exchange  # this rank's bucket all-to-alls
        self.holders = comm.holders  # Magma's sums
        self.rank = comm.rank
        # The first exception this rank's own work (Newton–Schulz, a read or a write of an
        # update) raised in the last run, agreed with the other ranks through the result
        # flags instead of leaving them in a collective.
        self.error: Exception | None = None
        self.entries = list(entries)
        self.settings = settings
        self.world_size = plan.world_size
        self.comm_dtype = settings.comm_dtype
        self.params = list({id(e.param): e.param for e in entries}.values())
        self.local_params = [local(p) for p in self.params]
        self.device = self.local_params[0].device
        self._views_of: list[list[int]] = [[] for _ in self.params]
        for index, e in enumerate(entries):
            self._views_of[e.param_index].append(index)
        self.groups = [entries[views[0]].group for views in self._views_of]
        self.magma = [j for j, g in enumerate(self.groups) if g["magma"]]
        self.bind_state(state)
        self.fusable_reads, self.fusable_writes = self._fusable()
        self._fused_reads = self._fused(self.fusable_reads)
        self._fused_writes = self._fused(self.fusable_writes)
        # Entries whose writes are a plain ``param += step·update`` (the decay ran before).
        self._plain_writes = frozenset(
            i
            for i, e in enumerate(entries)
            if i not in self._fused_writes and not e.group["cautious_wd"] and not e.group["magma"]
        )
        self._layouts: list[BucketLayout] = []
        for bucket in plan.buckets:
            first = sum(len(layout.stacks) for layout in self._layouts)
            self._layouts.append(bucket_layout(bucket, first, plan.world_size, self.peers))
        device = self.device

        def tensor(values: Sequence[float | int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        # Per matrix of every stack, in stack order: its parameter, whether this step drops
        # it (masked input) and the sum of its result (finite exactly when the result is),
        # so a step tests and flags every result at once instead of once per stack.
        matrix_params = [
            entries[i].param_index
            for bucket in self._layouts
            for layout in bucket.stacks
            for i in layout.layouts
        ]
        sizes = [layout.shape[0] for bucket in self._layouts for layout in bucket.stacks]
        self._matrix_params = tensor(matrix_params, torch.long)
        self._dropped = torch.zeros(len(matrix_params), dtype=torch.bool, device=device)
        self._dropped_views = list(self._dropped.split_with_sizes(sizes))
        self._result_sums = torch.zeros(len(matrix_params), device=device)
        self._sum_views = list(self._result_sums.split_with_sizes(sizes))
        self._stack_params = list(self._matrix_params.split_with_sizes(sizes))
        group_of = [entries[views[0]].group_index for views in self._views_of]
        self._lr_index = tensor(group_of, torch.long)
        self._wd_index = tensor([g + group_count for g in group_of], torch.long)
        self._cautious_mask = tensor([float(g["cautious_wd"]) for g in self.groups], torch.float32)
        self._plain_mask = 1.0 - self._cautious_mask
        self._entry_param = tensor([e.param_index for e in entries], torch.long)
        self._neg_scale = tensor(
            [-e.view.lr_scale(e.group["adjust_lr"]) for e in entries], torch.float32
        )
        # Step classes: entries of one group and one lr scale share a step where kept.
        classes: dict[tuple[int, float], int] = {}
        self._entry_class = [
            classes.setdefault((e.group_index, e.view.lr_scale(e.group["adjust_lr"])), len(classes))
            for e in entries
        ]
        self._class_group = tensor([g for g, _ in classes], torch.long)
        self._class_neg_scale = tensor([-scale for _, scale in classes], torch.float32)
        self.class_step = torch.zeros(len(classes), device=device)
        self._class_step_views = list(self.class_step.unbind(0))
        # This step's scalars, written in place every step; per-tensor views made once.
        self.decay = torch.ones(len(self.params), device=device)
        self.cautious = torch.zeros(len(self.params), device=device)
        self.step = torch.zeros(len(entries), device=device)
        self._decay_views = list(self.decay.unbind(0))
        self._group_count = group_count
        self.group_decay = torch.ones(group_count, device=device)
        self._group_decay_views = list(self.group_decay.unbind(0))
        self._cautious_views = list(self.cautious.unbind(0))
        self._step_views = list(self.step.unbind(0))
        self._row_maps = {
            j: _row_matrices([entries[i] for i in self._views_of[j]], comm) for j in self.magma
        }
        self._magma_steps: dict[int, torch.Tensor] = {}
        # The step's inputs, set by run().
        self.keep = torch.ones(len(self.params), dtype=torch.bool, device=device)
        self._keep_views = list(self.keep.unbind(0))
        self.ns_bad = torch.zeros(len(self.params), device=device)
        self.found_inf = torch.zeros((), device=device)
        self.ok = torch.ones((), dtype=torch.bool, device=device)  # not found_inf, by _scalars
        self._local_grad = [True] * len(self.params)
        self.grads: list[torch.Tensor] = []
        self._grad_views: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in self.params]
        self._grad_sources: list[torch.Tensor | None] = [None] * len(self.params)
        self._flat_grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._deferred: list[tuple[Sequence[LocalSlices], Sequence[torch.Tensor]]] | None = None
        # How each of the layouts' piece tuples is read and written, decided on its first
        # step; writes depend on which parameters have a local gradient, so they are decided
        # again when that changes.
        self._reads: dict[tuple[int, bool], _Reads] = {}
        self._writes: dict[Hashable, _Writes] = {}

    # -- plan time ----------------------------------------------------------------------

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the momentum buffers and Magma scores (again after a state load)."""
        self.momenta = [local(state[p]["momentum_buffer"]) for p in self.params]
        self.scores = {j: state[self.params[j]]["magma_score"] for j in self.magma}
        self._spans: dict[tuple[int, ...], list[tuple[Span, list[int], list[torch.Tensor]]]] = {}
        self._piece_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _fusable(self) -> tuple[frozenset[int], frozenset[int]]:
        """Entries whose local shard the step reads (writes) exactly once, so the read can
        also advance the momentum and the write also decay, in one pass.

        Magma needs the advanced momentum before any read and scales rows by a tensor;
        cautious decay needs the update's sign: both keep their separate passes.
        """
        reads, writes = local_pieces(self.plan)
        fusable_reads: set[int] = set()
        fusable_writes: set[int] = set()
        for j, views in enumerate(self._views_of):
            group, shape = self.groups[j], self.local_params[j].shape
            if group["magma"]:
                continue
            if covers_exactly(shape, [piece for i in views for piece in reads[i]]):
                fusable_reads.update(views)
            if not group["cautious_wd"] and covers_exactly(
                shape, [piece for i in views for piece in writes[i]]
            ):
                fusable_writes.update(views)
        return frozenset(fusable_reads), frozenset(fusable_writes)

    def _fused(self, fusable: frozenset[int]) -> frozenset[int]:
        """The fusable entries whose tensors take the fused form under the backend."""
        backend = self.settings.backend
        return frozenset(
            i
            for i in fusable
            if fused_form(
                backend,
                self.local_params[self.entries[i].param_index],
                self.momenta[self.entries[i].param_index],
            )
        )

    # -- the step -----------------------------------------------------------------------

    def run(
        self,
        grads: Sequence[torch.Tensor | None],
        keep: torch.Tensor,
        found_inf: torch.Tensor,
        ns_bad: torch.Tensor,
        hyper: torch.Tensor,
        agree_on_results: Callable[[], None],
        transactional: bool,
    ) -> None:
        """One Muon phase. ``grads`` are the local gradients (None where absent), ``keep`` the
        agreed per-parameter mask and ``found_inf`` the step's flag (a parameter with a local
        gradient has ``keep = not found_inf``, which lets its decay share one launch with its
        group's), ``ns_bad`` (zeroed) counts non-finite Newton–Schulz results per parameter
        and ends with a slot for this rank's failure (rank + 1) when Newton–Schulz raises,
        ``hyper`` holds the step's lr and weight decay per group.
        ``agree_on_results`` all-reduces the Newton–Schulz flags (and, when transactional,
        updates ``keep``) before the deferred writes."""
        self.error = None
        self._set_grads(grads)
        self.keep.copy_(keep)
        torch.index_select(self.keep, 0, self._matrix_params, out=self._dropped)
        self._dropped.logical_not_()
        self.found_inf = found_inf
        self.ns_bad = ns_bad
        self._scalars(hyper)
        if not transactional:
            self._advance_state(store_all=False)
        self._deferred = [] if transactional else None
        buckets = self.plan.buckets
        run_tasks(
            (
                bucket_task(b, layout, self)
                for b, layout in zip(buckets, self._layouts, strict=True)
            ),
            self.settings.max_inflight,
        )
        self._flag_results()
        agree_on_results()
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self.keep.copy_(keep)
            self._scalars(hyper)
            self._advance_state(store_all=True)
            self._write_all(
                tuple(piece for pieces, _ in deferred for piece in pieces),
                [update for _, updates in deferred for update in updates],
                key=tuple(id(pieces) for pieces, _ in deferred),
                unchecked=True,
            )

    def _set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Local gradients, zeros where absent; piece views are kept while a gradient stays."""
        self.grads = []
        local_grad = [grad is not None for grad in grads]
        if local_grad != self._local_grad:
            self._local_grad = local_grad
            self._writes.clear()
        for j, grad in enumerate(grads):
            if grad is None:
                grad = torch.zeros_like(self.local_params[j])
            if grad is not self._grad_sources[j]:
                self._grad_sources[j] = grad
                self._grad_views[j] = {}
                self._flat_grads[j] = None
            self.grads.append(grad)

    def _scalars(self, hyper: torch.Tensor) -> None:
        """This step's decay, cautious rate and step size per tensor, zero effect off ``keep``."""
        keep = self.keep.float()
        lr = hyper.index_select(0, self._lr_index)
        rate = lr * hyper.index_select(0, self._wd_index) * keep
        torch.sub(1.0, rate * self._plain_mask, out=self.decay)
        torch.mul(rate, self._cautious_mask, out=self.cautious)
        per_entry = (lr * keep).index_select(0, self._entry_param)
        torch.mul(per_entry, self._neg_scale, out=self.step)
        groups = self._group_count
        torch.eq(self.found_inf, 0, out=self.ok)
        ok = self.ok.float()
        group_rate = hyper[:groups] * hyper[groups : 2 * groups] * ok
        torch.sub(1.0, group_rate, out=self.group_decay)
        class_lr = hyper.index_select(0, self._class_group) * ok
        torch.mul(class_lr, self._class_neg_scale, out=self.class_step)

    def _advance_state(self, store_all: bool) -> None:
        """Momentum (one foreach pass per coefficient), Magma and the unfused decay."""
        by_beta: dict[float, list[int]] = {}
        for j, group in enumerate(self.groups):
            if store_all or self._views_of[j][0] not in self._fused_reads:
                by_beta.setdefault(group["momentum"], []).append(j)
        # A parameter with a local gradient is kept exactly when the step is: those share one
        # flag and, lying in order in their group's buffer, one select per span. The others
        # carry their own flag, which depends on the other ranks' gradients.
        ok = self.ok
        for beta, members in by_beta.items():
            shared = tuple(j for j in members if self._local_grad[j])
            for span, chosen, flat_momenta in self._momentum_spans(shared):
                flat_grads = [self._flat_grad(j) for j in chosen]
                if span.flat is not None and all(g is not None for g in flat_grads):
                    grads = cast(list[torch.Tensor], flat_grads)
                    store_momenta_(grads, flat_momenta, beta, ok, span)
                else:
                    grads = [self.grads[j] for j in chosen]
                    store_momenta_(grads, [self.momenta[j] for j in chosen], beta, ok)
            for j in members:
                if not self._local_grad[j]:
                    store_momenta_([self.grads[j]], [self.momenta[j]], beta, self._keep_views[j])
        if self.magma:
            self._magma()
        # Parameters with a local gradient decay by their group's factor, one launch per
        # group; the others by their own, which depends on the other ranks' gradients.
        by_group: dict[int, list[int]] = {}
        alone: list[int] = []
        for j, group in enumerate(self.groups):
            if group["cautious_wd"] or self._views_of[j][0] in self._fused_writes:
                continue
            if self._local_grad[j]:
                by_group.setdefault(self.entries[self._views_of[j][0]].group_index, []).append(j)
            else:
                alone.append(j)
        for g, members in by_group.items():
            torch._foreach_mul_([self.local_params[j] for j in members], self._group_decay_views[g])
        if alone:
            torch._foreach_mul_(
                [self.local_params[j] for j in alone], [self._decay_views[j] for j in alone]
            )

    def _momentum_spans(
        self, members: tuple[int, ...]
    ) -> list[tuple[Span, list[int], list[torch.Tensor]]]:
        """Runs of ``members`` whose momenta lie in order in one buffer, with each run's
        parameters and one-dimensional momentum views; found once per set of members."""
        found = self._spans.get(members)
        if found is None:
            found = self._spans[members] = [
                (span, chosen, [self.momenta[j].view(-1) for j in chosen])
                for span in spans([self.momenta[j] for j in members])
                for chosen in ([members[i] for i in span.members],)
            ]
        return found

    def _flat_grad(self, j: int) -> torch.Tensor | None:
        """The local gradient as one dimension, if it can share its momentum's span."""
        flat = self._flat_grads[j]
        if flat is None:
            grad = self.grads[j]
            if grad.is_contiguous() and grad.dtype == self.momenta[j].dtype:
                flat = self._flat_grads[j] = grad.view(-1)
        return flat

    def _magma(self) -> None:
        """Damp Magma parameters' steps per matrix by momentum-gradient agreement.

        Each rank sums dot products and squared norms of its rows per matrix; one all-reduce
        completes them, so every rank sees the cosine of the whole matrix. Replicas add a
        piece once per copy, which the cosine's ratio cancels.
        """
        sums = []
        for j in self.magma:
            m, g = self.momenta[j].float(), self.grads[j].float()
            dims = tuple(range(1, m.ndim))
            per_row = torch.stack([(m * g).sum(dims), m.square().sum(dims), g.square().sum(dims)])
            total = torch.zeros(3, self.scores[j].numel(), device=self.device)
            sums.append(total.index_add_(1, self._row_maps[j], per_row))
        totals = torch.cat(sums, dim=1)
        if self.holders.size > 1:
            dist.all_reduce(totals, group=self.holders.group)
        offset = 0
        for j in self.magma:
            score = self.scores[j]
            dot, mm, gg = totals[:, offset : offset + score.numel()]
            offset += score.numel()
            cosine = (dot / (mm.sqrt() * gg.sqrt()).clamp_min(_MAGMA_EPS)).clamp(-1.0, 1.0)
            beta = self.groups[j]["magma_beta"]
            new = score * beta + (1.0 + cosine) / 2.0 * (1.0 - beta)
            torch.where(self._keep_views[j], new, score, out=score)
            damping = (MAGMA_MIN_SCALE + (1.0 - MAGMA_MIN_SCALE) * score)[self._row_maps[j]]
            shape = (-1, *[1] * (self.local_params[j].ndim - 1))
            for i in self._views_of[j]:
                self._magma_steps[i] = (damping * self._step_views[i]).view(shape)

    def _pieces(self, index: int, slices: Slices) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameter and momentum views of a piece, made once per plan."""
        key = (index, id(slices))
        views = self._piece_views.get(key)
        if views is None:
            j = self.entries[index].param_index
            views = self._piece_views[key] = (self.local_params[j][slices], self.momenta[j][slices])
        return views

    def _grad_piece(self, index: int, slices: Slices) -> torch.Tensor:
        j = self.entries[index].param_index
        key = (index, id(slices))
        view = self._grad_views[j].get(key)
        if view is None:
            grad = self.grads[j]
            view = self._grad_views[j][key] = grad if is_whole(slices, grad.shape) else grad[slices]
        return view

    # -- the bucket tasks' context ------------------------------------------------------

    def read_updates(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        try:
            self._read_updates(pieces, outs)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            # Zero inputs orthogonalize to zero: the stack stays finite, the write a no-op.
            torch._foreach_zero_(list(outs))
            self._fail(exc, [self.entries[index].param_index for index, _ in pieces])

    def _read_updates(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        key = (id(pieces), self._deferred is None)
        reads = self._reads.get(key)
        if reads is None:
            reads = self._reads[key] = self._plan_reads(pieces)
        for (fused, group), positions in reads.advancing:
            pre_orthogonalize_(
                [self._grad_piece(*pieces[i]) for i in positions],
                [self._pieces(*pieces[i])[1] for i in positions],
                [outs[i] for i in positions],
                beta=group["momentum"],
                mix=_nesterov_mix(group),
                keeps=[self._keep_views[self.entries[pieces[i][0]].param_index] for i in positions],
                store=self._deferred is None,
                fused=fused,
            )
        for group, positions in reads.advanced:
            ns_inputs_(
                [self._grad_piece(*pieces[i]) for i in positions],
                [self._pieces(*pieces[i])[1] for i in positions],
                [outs[i] for i in positions],
                _nesterov_mix(group),
            )

    def _plan_reads(self, pieces: Sequence[LocalSlices]) -> _Reads:
        """One batch per form and group: pieces whose momentum advances here (fused, or a
        transactional step's read) and pieces whose momentum advanced before, which only
        need the Nesterov mix and the cast to ``out``."""
        advancing: dict[tuple[bool, int], list[int]] = {}
        advanced: dict[int, list[int]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for i, (index, _) in enumerate(pieces):
            entry = self.entries[index]
            groups[entry.group_index] = entry.group
            fused = index in self._fused_reads
            if self._deferred is not None or fused:
                advancing.setdefault((fused, entry.group_index), []).append(i)
            else:
                advanced.setdefault(entry.group_index, []).append(i)
        return _Reads(
            tuple(((f, groups[g]), tuple(positions)) for (f, g), positions in advancing.items()),
            tuple((groups[g], tuple(positions)) for g, positions in advanced.items()),
        )

    def orthogonalize(self, stack: torch.Tensor, layout: StackLayout) -> torch.Tensor:
        mask_stack_(stack, self._dropped_views[layout.index])
        steps, coefficients, parts, method = cast(
            tuple[int, Coefficients, PartSplit | None, str], layout.ns_key
        )

        def run(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(
                x,
                steps=steps,
                coefficients=coefficients,
                dtype=self.settings.ns_dtype,
                backend=self.settings.backend,
                method=method,
            )

        try:
            result = run(stack) if parts is None else parts.orthogonalize(stack, run)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            self._fail(exc, self._stack_params[layout.index])
            self._sum_views[layout.index].zero_()
            return stack.new_zeros(stack.shape, dtype=self.settings.ns_dtype)
        # One sum per matrix instead of an elementwise test: a sum is finite exactly when
        # every entry is, since Newton–Schulz entries are O(1) and cannot overflow it.
        torch.sum(result, dim=(-2, -1), dtype=torch.float32, out=self._sum_views[layout.index])
        return result

    def _flag_results(self) -> None:
        """Count each parameter's non-finite Newton–Schulz results of this step."""
        bad = torch.isfinite(self._result_sums).logical_not_().float()
        self.ns_bad.index_add_(0, self._matrix_params, bad)

    def apply(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        try:
            if self.settings.ns_dtype != self.comm_dtype:
                # Owners add their own result in the dtype the other holders receive it in,
                # so replicas of a parameter round identically and stay bitwise equal. Piece
                # by piece: a cast of whole stacks would hold both dtypes' stacks at once.
                updates = [update.to(self.comm_dtype) for update in updates]
            if self._deferred is not None:
                self._deferred.append((pieces, updates))
                return
            self._write_all(pieces, updates)
        except Exception as exc:  # raised by step() once the other ranks know (see run)
            self._fail(exc, [self.entries[index].param_index for index, _ in pieces])

    def _fail(self, exc: Exception, params: torch.Tensor | Sequence[int]) -> None:
        """Record an exception of this rank's own work on ``params`` (Newton–Schulz, a read
        or a write) in the result flags, which ``run`` all-reduces with the other ranks', so
        they learn of it there instead of waiting in a collective this rank never joins;
        the first exception is raised on this rank after the step."""
        self.error = self.error or exc
        self.ns_bad[-1:].fill_(float(self.rank + 1))
        if not isinstance(params, torch.Tensor):
            params = torch.tensor(list(params), dtype=torch.long, device=self.device)
        self.ns_bad.index_fill_(0, params, 1.0)

    def _write_all(
        self,
        pieces: Sequence[LocalSlices],
        updates: Sequence[torch.Tensor],
        key: Hashable = None,
        unchecked: bool = False,
    ) -> None:
        """Write updates; plain pieces (torch form, no Magma or cautious decay) batched.

        A plain piece of a parameter with a local gradient has the step of its class (group
        and lr scale), so each class takes three multi-tensor launches: cast the updates to
        the parameters' dtype, scale them, add them. Other plain pieces take one foreach
        ``addcmul`` with their own steps; the rest go one by one. ``unchecked`` updates (a
        transactional step's) may be non-finite where ``keep`` is false, and a zero step
        does not cancel them: they are selected away, for a class in one pass over its
        scaled updates, since its parameters are kept exactly when the step is. ``key``
        names ``pieces`` across steps (by default the tuple itself, one of the layouts').
        """
        key = id(pieces) if key is None else key
        writes = self._writes.get(key)
        if writes is None:
            writes = self._writes[key] = self._plan_writes(pieces)
        if unchecked:
            updates = list(updates)
            for i in writes.masked:
                j = self.entries[pieces[i][0]].param_index
                updates[i] = torch.where(self._keep_views[j], updates[i], 0.0)
        for i in writes.alone:
            self._write(*pieces[i], updates[i])
        if writes.loose:
            torch._foreach_addcmul_(
                list(writes.loose_targets),
                [updates[i] for i in writes.loose],
                list(writes.loose_steps),
            )
        for cls in writes.classes:
            flat = torch.empty(runs_numel(cls.runs), dtype=cls.dtype, device=self.device)
            scaled = flat_views(flat, cls.runs)
            torch._foreach_copy_(scaled, [updates[i] for i in cls.positions])
            torch._foreach_mul_(scaled, self._class_step_views[cls.step])
            if unchecked:
                flat.masked_fill_(self.ok.logical_not(), 0.0)
            torch._foreach_add_(list(cls.targets), scaled)

    def _plan_writes(self, pieces: Sequence[LocalSlices]) -> _Writes:
        alone: list[int] = []
        loose: list[int] = []
        classes: dict[int, dict[torch.dtype, list[int]]] = {}
        for i, (index, slices) in enumerate(pieces):
            if index not in self._plain_writes:
                alone.append(i)
            elif self._local_grad[self.entries[index].param_index]:
                dtype = self._pieces(index, slices)[0].dtype
                classes.setdefault(self._entry_class[index], {}).setdefault(dtype, []).append(i)
            else:
                loose.append(i)
        targets = [self._pieces(*piece)[0] for piece in pieces]
        return _Writes(
            tuple(i for i in alone + loose if pieces[i][0] not in self._fused_writes),
            tuple(alone),
            tuple(loose),
            tuple(targets[i] for i in loose),
            tuple(self._step_views[pieces[i][0]] for i in loose),
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

    def _write(self, index: int, slices: Slices, update: torch.Tensor) -> None:
        j = self.entries[index].param_index
        target, _ = self._pieces(index, slices)
        magma_step = self._magma_steps.get(index)
        step = magma_step[slices[0]] if magma_step is not None else self._step_views[index]
        fused = index in self._fused_writes
        post_orthogonalize_(
            target,
            update,
            step=step,
            keep=self._keep_views[j],
            decay=self._decay_views[j] if fused else None,
            cautious=self._cautious_views[j] if self.groups[j]["cautious_wd"] else None,
            fused=fused,
        )
