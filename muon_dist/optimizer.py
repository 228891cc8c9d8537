"""The Muon optimizer: Muon for hidden matrices, AdamW for the rest, in one torch Optimizer."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_update

from muon_dist.groups import CommGroups, Peers, comm_groups
from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.dispatch import newton_schulz, validate_backend
from muon_dist.kernels.elementwise import (
    advance_momentum,
    decay_and_update_,
    momentum_input_,
    nesterov_input_,
)
from muon_dist.kernels.gram import METHODS as NS_METHODS
from muon_dist.plan import (
    REPLICA_MODES,
    Plan,
    build_plan,
    covers_exactly,
    layout_of,
    local,
    local_pieces,
    local_rows,
)
from muon_dist.qk_clip import MaxLogitTracker, QKClip, QKClipper
from muon_dist.routing import (
    ADJUST_LR,
    ALGORITHMS,
    MUON_MODES,
    MatrixView,
    PartSplit,
    format_routing_table,
    group_param_names,
    matrix_views,
    named_params,
    routing_entries,
)
from muon_dist.runtime import run_tasks
from muon_dist.runtime.bucket_task import bucket_task

logger = logging.getLogger(__name__)

# Group keys every rank must share: they decide the matrix views, the plan and which
# collectives run. Hyper-parameters such as lr are read fresh every step instead.
_AGREE_KEYS = (
    "algorithm",
    "muon_mode",
    "experts",
    "num_experts",
    "num_heads",
    "split_sizes",
    "split_groups",
    "transposed",
    "ns_steps",
    "coefficients",
    "ns_method",
    "magma",
    "cautious_wd",
)
# Muon-only group keys: an AdamW group that sets one is a configuration mistake.
MUON_ONLY_KEYS = (
    "num_heads",
    "split_sizes",
    "split_groups",
    "transposed",
    "magma",
    "magma_beta",
    "cautious_wd",
    "ns_method",
)
_MAX_CACHED_PLANS = 8
NONFINITE_POLICIES = ("raise", "skip_step")
# Magma-lite: the update of a matrix is damped to MIN + (1 - MIN) * score, where the score is
# an EMA of (1 + cos(momentum, gradient)) / 2 over steps, started at 1 (no damping).
MAGMA_MIN_SCALE = 0.1
_MAGMA_EPS = 1e-12


def _check_range(name: str, value: float, low: float, high: float, *, closed_high: bool) -> None:
    ok = low <= value <= high if closed_high else low <= value < high
    if not ok:
        bracket = "]" if closed_high else ")"
        raise ValueError(
            f"{name}={value!r} is out of range; it must lie in [{low}, {high}{bracket}"
        )


@dataclass
class _MuonParam:
    """Per-step handles of one matrix view of a Muon parameter, in plan order.

    A parameter cut by ``split_sizes`` has one entry per row block; its matrices are
    numbered across its views from ``first_matrix`` on (Magma keeps one score per matrix).
    """

    param: torch.Tensor
    group: dict[str, Any]
    view: MatrixView
    name: str
    first_matrix: int


@dataclass(frozen=True)
class _StepPlan:
    """A plan, and the entries whose local shard the step reads (``fused_reads``) or writes
    (``fused_writes``) exactly once, so that one pass can also advance the momentum or
    apply the weight decay there instead of a separate pass over the whole tensor."""

    plan: Plan
    fused_reads: frozenset[int]
    fused_writes: frozenset[int]


def _step_plan(plan: Plan, entries: Sequence[_MuonParam]) -> _StepPlan:
    # Magma needs the advanced momentum before any read and scales rows by a tensor;
    # cautious decay needs the update's sign: both keep their separate passes.
    reads, writes = local_pieces(plan)
    by_tensor: dict[int, list[int]] = {}
    for index, entry in enumerate(entries):
        by_tensor.setdefault(id(entry.param), []).append(index)
    fused_reads: set[int] = set()
    fused_writes: set[int] = set()
    for indices in by_tensor.values():
        first = entries[indices[0]]
        if first.group["magma"]:
            continue
        shape = local(first.param).shape
        if covers_exactly(shape, [piece for i in indices for piece in reads[i]]):
            fused_reads.update(indices)
        if not first.group["cautious_wd"] and covers_exactly(
            shape, [piece for i in indices for piece in writes[i]]
        ):
            fused_writes.update(indices)
    return _StepPlan(plan, frozenset(fused_reads), frozenset(fused_writes))


class Muon(torch.optim.Optimizer):
    """Distributed Muon with AdamW for non-matrix parameters.

    Groups carry ``"algorithm": "muon" | "adamw"``; a group without it is split, >=2-D
    parameters to Muon and the rest to AdamW. Muon parameters may be plain tensors or
    DTensors on any mesh (FSDP2, HSDP, expert or tensor parallel): whole matrices are
    gathered onto one owner rank each, orthogonalized there, and scattered back, so the
    update equals single-device Muon.

    Per group, ``num_heads`` orthogonalizes each head's rows separately, ``split_sizes`` each
    block of a fused weight (QKV, gate+up), ``magma=True`` damps each matrix's update by how
    well its gradient agrees with its momentum, and ``cautious_wd=True`` decays only weights
    whose sign the update shares. ``ns_method`` ("auto", "gram", "standard") picks the
    Newton–Schulz iteration (see :func:`muon_dist.kernels.newton_schulz`). ``qk_clip`` (with
    ``max_logits``) rescales attention query and key heads whose logits exceed tau after
    each step (see :mod:`muon_dist.qk_clip`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adjust_lr: str | None = "spectral_norm",
        ns_steps: int = 5,
        coefficients: str | Sequence[Sequence[float]] = "quintic",
        backend: str = "auto",
        ns_method: str = "auto",
        comm_dtype: torch.dtype = torch.bfloat16,
        *,
        muon_mode: str = "2d",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        bucket_bytes: int = 128 * 2**20,
        max_inflight: int = 3,
        replica_mode: str = "split",
        ns_dtype: torch.dtype = torch.bfloat16,
        nonfinite: str = "raise",
        magma: bool = False,
        magma_beta: float = 0.9,
        cautious_wd: bool = False,
        qk_clip: Sequence[QKClip] = (),
        max_logits: MaxLogitTracker | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        validate_backend(backend)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r}; choose one of {list(NONFINITE_POLICIES)}")
        for key, value in (("comm_dtype", comm_dtype), ("ns_dtype", ns_dtype)):
            if value not in (torch.bfloat16, torch.float32):
                raise ValueError(f"{key}={value}; choose torch.bfloat16 or torch.float32")
        if replica_mode not in REPLICA_MODES:
            raise ValueError(f"replica_mode={replica_mode!r}; choose one of {list(REPLICA_MODES)}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be a positive number of bytes")
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight} must be >= 1")
        self._defaults_by_algorithm: dict[str, dict[str, Any]] = {
            "muon": {
                "lr": lr,
                "momentum": momentum,
                "nesterov": nesterov,
                "weight_decay": weight_decay,
                "adjust_lr": adjust_lr,
                "ns_steps": ns_steps,
                "coefficients": coefficients,
                "ns_method": ns_method,
                "muon_mode": muon_mode,
                "experts": False,
                "num_experts": None,
                "num_heads": None,
                "split_sizes": None,
                "split_groups": 1,
                "transposed": False,
                "magma": magma,
                "magma_beta": magma_beta,
                "cautious_wd": cautious_wd,
            },
            "adamw": {
                "lr": adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            },
        }
        self.backend = backend
        self.comm_dtype = comm_dtype
        self.ns_dtype = ns_dtype
        self.nonfinite = nonfinite
        self.bucket_bytes = bucket_bytes
        self.max_inflight = max_inflight
        self.replica_mode = replica_mode
        # Plans by parameter set: the set shrinks on steps where some parameters have no
        # gradient anywhere, and those sets tend to recur, so each is planned once.
        self._plans: dict[Hashable, _StepPlan] = {}
        self._row_maps: dict[Hashable, torch.Tensor] = {}
        # What torch reads: its schedulers scale "lr" and cycle "momentum" (OneCycleLR,
        # CyclicLR), which is Muon's; AdamW groups keep their betas and drop the key.
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(_split_by_algorithm(params), defaults=defaults)
        self._comm = comm_groups(
            [p for g in self.param_groups for p in g["params"]], replica_mode, process_group
        )
        self._check_ranks_agree(qk_clip)
        entries = self._muon_params()
        if entries:
            self._get_plan(entries)  # unsupported layouts fail here, not mid-training
        if max_logits is not None and not qk_clip:
            raise ValueError("max_logits is only read by qk_clip; pass qk_clip=[QKClip(...)]")
        self._qk_clip = (
            QKClipper(
                qk_clip, max_logits, self._named_params(), self._comm.rank, self._comm.holders
            )
            if qk_clip
            else None
        )
        logger.info("muon_dist.Muon routing:\n%s", self.routing_table())

    # -- construction -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm", "muon")
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm={algorithm!r} is not supported; choose one of {ALGORITHMS}"
            )
        group = {**self._defaults_by_algorithm[algorithm], **param_group, "algorithm": algorithm}
        _validate_group(group, len(self.param_groups))
        group.setdefault("steps", 0)
        group.setdefault("skipped_steps", 0)
        super().add_param_group(group)
        if algorithm == "adamw" and "momentum" not in param_group:
            del group["momentum"]  # torch's defaults put Muon's momentum in every group
        names = group_param_names(group, len(self.param_groups) - 1)
        for p, name in zip(group["params"], names, strict=True):
            state = self.state[p]
            if algorithm == "muon":
                state["momentum_buffer"] = torch.zeros_like(p)
                if group["magma"]:
                    count = _matrix_count(group, p, name)
                    state["magma_score"] = torch.ones(count, device=local(p).device)
            else:
                fused = local(p).is_cuda
                state["step"] = torch.tensor(0.0, device=local(p).device if fused else None)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by Muon, refusing one whose routing no longer matches."""
        _check_saved_routing(state_dict, self.param_groups)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        scores = {
            p: state_dict["state"][i]["magma_score"]
            for i, p in zip(saved_ids, params, strict=True)
            if "magma_score" in state_dict["state"].get(i, {})
        }
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts state to the parameter dtype; scores stay fp32.
        for p, score in scores.items():
            self.state[p]["magma_score"] = score.to(local(p).device, torch.float32, copy=True)

    def routing_table(self) -> str:
        """Which parameter goes where, its matrix view and lr scale, as printable text."""
        return format_routing_table(routing_entries(self.param_groups))

    def _named_params(self) -> dict[str, torch.Tensor]:
        return {name: p for name, _, p in named_params(self.param_groups)}

    def _check_ranks_agree(self, qk_clip: Sequence[QKClip]) -> None:
        """Fail fast, instead of hanging in a collective, when ranks hold different params."""
        holders = self._comm.holders
        if holders.size == 1:
            return
        rank, first = self._comm.rank, holders.ranks[0]
        lines = [repr(spec) for spec in qk_clip]
        for name, group, p in named_params(self.param_groups):
            options = {k: group.get(k) for k in _AGREE_KEYS}
            placements = p.placements if isinstance(p, DTensor) else "plain"
            mesh = tuple(p.device_mesh.shape) if isinstance(p, DTensor) else ()
            lines.append(f"{name} {tuple(p.shape)} {p.dtype} {placements} {mesh} {options}")
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        digests: list[str | None] = [None] * holders.size
        dist.all_gather_object(digests, digest, group=holders.group)
        if len(set(digests)) == 1:
            return
        all_lines: list[list[str] | None] = [None] * holders.size
        dist.all_gather_object(all_lines, lines, group=holders.group)
        reference = all_lines[0] or []
        for other, other_lines in zip(holders.ranks, all_lines, strict=True):
            other_lines = other_lines or []
            if other_lines == reference:
                continue
            diff = next(
                (
                    (i, a, b)
                    for i, (a, b) in enumerate(zip(reference, other_lines, strict=False))
                    if a != b
                ),
                (min(len(reference), len(other_lines)), "<end>", "<end>"),
            )
            raise RuntimeError(
                f"muon_dist.Muon: rank {other} built a different parameter list than rank "
                f"{first} (this is rank {rank}); rank {first} has {len(reference)} params, rank "
                f"{other} has {len(other_lines)}; first difference at entry {diff[0]}: rank "
                f"{first} {diff[1]!r} vs rank {other} {diff[2]!r}. Build the model and param "
                "groups identically on every rank that holds them."
            )

    # -- step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step for every group; all ranks first agree which gradients exist and are finite.

        A parameter with no gradient on any rank is left untouched. A non-finite gradient
        anywhere raises (``nonfinite="raise"``) or skips the whole step on every rank
        (``"skip_step"``), leaving parameters and state as they were.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = self._muon_params()
        present, nonfinite = self._agree_on_gradients()
        step = self.param_groups[0]["steps"] + 1
        if nonfinite:
            return self._skip_or_raise(step, f"non-finite gradient in {', '.join(nonfinite)}", loss)
        # Under "skip_step" the Muon phase only computes: momentum, decay and updates are
        # committed once every rank knows all Newton–Schulz results are finite.
        transactional = self.nonfinite == "skip_step"
        context = self._muon_phase([e for e in muon if present[id(e.param)]], transactional)
        broken = context.nonfinite_results() if context is not None else []
        if (
            transactional
            and context is not None
            and _any_rank(bool(broken), context.device, self._comm.holders)
        ):
            names = ", ".join(broken) or "parameters owned by another rank"
            return self._skip_or_raise(step, f"non-finite Newton–Schulz result for {names}", loss)
        if broken:
            raise FloatingPointError(
                f"muon_dist.Muon step {step}: Newton–Schulz returned non-finite values for "
                f"{', '.join(broken)} although every gradient was finite; either a momentum "
                "grew past a Frobenius norm of about 1.8e19 (lower the lr or clip gradients) "
                "or a kernel or device failed (try backend='torch'); those parameters were "
                "updated"
            )
        for group in self.param_groups:
            group["steps"] += 1
            if group["algorithm"] == "adamw":
                self._adamw_group_step(group)
        if transactional and context is not None:
            context.commit()
        if self._qk_clip is not None:
            self._qk_clip()
        return loss

    def _skip_or_raise(self, step: int, reason: str, loss: Any) -> Any:
        """Apply the ``nonfinite`` policy; every rank reaches the same decision."""
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"muon_dist.Muon step {step}: {reason}; fix the loss or pass "
                "nonfinite='skip_step' to skip such steps"
            )
        for group in self.param_groups:
            group["skipped_steps"] += 1
            group["steps"] += 1
        if self._qk_clip is not None:
            self._qk_clip.tracker.pop()  # logits of the skipped batch
        logger.warning(
            "muon_dist.Muon: skipped step %d (%s); %d skipped so far",
            step,
            reason,
            self.param_groups[0]["skipped_steps"],
        )
        return loss

    def _agree_on_gradients(self) -> tuple[dict[int, bool], list[str]]:
        """Which parameters have a gradient on some rank, and which have a non-finite one.

        One small all-reduce answers both, so ranks take identical decisions and their
        collectives stay matched. A Muon parameter with a gradient on some ranks only (an
        expert no local token reached) then takes part everywhere, with zeros where absent.
        """
        named = [(name, p) for name, _, p in named_params(self.param_groups)]
        if not named:
            return {}, []
        count = len(named)
        device = local(named[0][1]).device
        flags = torch.zeros(2 * count, dtype=torch.float32, device=device)
        with_grad = [i for i, (_, p) in enumerate(named) if p.grad is not None]
        if with_grad:
            index = torch.tensor(with_grad, device=device)
            norms = torch._foreach_norm([local(named[i][1].grad) for i in with_grad])
            flags[index] = 1.0
            flags[index + count] = (~torch.isfinite(torch.stack(norms).float())).float()
        if self._comm.holders.size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._comm.holders.group)
        values = flags.tolist()
        present = {id(p): values[i] > 0 for i, (_, p) in enumerate(named)}
        nonfinite = [name for i, (name, _) in enumerate(named) if values[count + i] > 0]
        return present, nonfinite

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        fused = all(local(p).is_cuda for p in params)
        beta1, beta2 = group["betas"]
        adamw_update(
            [local(p) for p in params],
            [local(p.grad) for p in params],
            [local(s["exp_avg"]) for s in states],
            [local(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            foreach=not fused,
            fused=fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_params(self) -> list[_MuonParam]:
        out = []
        for name, group, p in named_params(self.param_groups):
            if group["algorithm"] != "muon":
                continue
            first = 0
            for view in matrix_views(p.shape, group, name):
                out.append(_MuonParam(p, group, view, view.label(name), first))
                first += view.count
        return out

    def _row_matrices(self, entries: Sequence[_MuonParam]) -> torch.Tensor:
        """For each dim-0 row of this rank's shard, which of the parameter's matrices it is in.

        ``entries`` are all the views of one parameter; the answer is cached per layout.
        """
        key = (id(entries[0].param), tuple(e.view for e in entries))
        cached = self._row_maps.get(key)
        if cached is None:
            first = entries[0]
            layout = layout_of(first.param, first.name, first.view, self._comm.holders.ranks)
            lo, hi = local_rows(layout, self._comm.rank)
            rows = torch.arange(lo, hi)
            cached = torch.zeros_like(rows)
            for e in entries:
                start, stop = e.view.box(0, e.view.count)[0]
                inside = (rows >= start) & (rows < stop)
                cached[inside] = e.first_matrix + (rows[inside] - start) // e.view.dim0_step
            cached = cached.to(local(first.param).device)
            self._row_maps[key] = cached
        return cached

    def _get_plan(self, entries: Sequence[_MuonParam]) -> _StepPlan:
        rank, world_size = self._comm.rank, self._comm.world_size
        key = (
            rank,
            world_size,
            self.bucket_bytes,
            self.replica_mode,
            self.comm_dtype,
            tuple((id(e.param), e.view, _ns_key(e.group, e.view)) for e in entries),
        )
        cached = self._plans.get(key)
        if cached is None:
            layouts = [
                layout_of(
                    e.param, e.name, e.view, self._comm.holders.ranks, _ns_key(e.group, e.view)
                )
                for e in entries
            ]
            plan = build_plan(
                layouts,
                rank,
                world_size,
                bucket_bytes=self.bucket_bytes,
                itemsize=self.comm_dtype.itemsize,
                replica_mode=self.replica_mode,
                steps=[e.group["ns_steps"] for e in entries],
            )
            if len(self._plans) >= _MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            cached = self._plans[key] = _step_plan(plan, entries)
            logger.debug("muon_dist: built a plan with %d buckets", len(plan.buckets))
        return cached

    def _muon_phase(self, entries: list[_MuonParam], transactional: bool) -> _StepContext | None:
        """Gather, orthogonalize and scatter every bucket; apply now, or keep for ``commit``."""
        if not entries:
            return None
        step_plan = self._get_plan(entries)
        context = _StepContext(self, entries, step_plan, self._comm, transactional)
        run_tasks((bucket_task(b, context) for b in step_plan.plan.buckets), self.max_inflight)
        return context


def _any_rank(flag: bool, device: torch.device, peers: Peers) -> bool:
    """True on every rank of ``peers`` if ``flag`` is true on any (one tiny all-reduce)."""
    if peers.size == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=peers.group)
    return bool(value.item())


class _StepContext:
    """Local tensors and hyper-parameters of one step, indexed by plan position.

    Entries that are views of one parameter share its tensors; momentum and decoupled decay
    touch each parameter once, and each element is then updated by exactly one view.
    """

    def __init__(
        self,
        optimizer: Muon,
        entries: Sequence[_MuonParam],
        step_plan: _StepPlan,
        comm: CommGroups,
        transactional: bool,
    ) -> None:
        self.optimizer = optimizer
        self.entries = entries
        # A transactional step cannot advance the momentum as it reads: it may be skipped.
        self.fused_reads = frozenset() if transactional else step_plan.fused_reads
        self.fused_writes = step_plan.fused_writes
        self.world_size = comm.world_size
        self.peers = comm.exchange
        self.holders = comm.holders
        self.comm_dtype = optimizer.comm_dtype
        self.backend = optimizer.backend
        self.ns_dtype = optimizer.ns_dtype
        self.params = [local(e.param) for e in entries]
        self.device = self.params[0].device
        self.grads = [
            local(e.param.grad) if e.param.grad is not None else torch.zeros_like(p)
            for e, p in zip(entries, self.params, strict=True)
        ]
        self.momenta = [local(optimizer.state[e.param]["momentum_buffer"]) for e in entries]
        self.momentum = [e.group["momentum"] for e in entries]
        self.mix = [e.group["momentum"] if e.group["nesterov"] else None for e in entries]
        # A float, or per local dim-0 row for Magma, whose damping differs per matrix.
        self.step_size: list[float | torch.Tensor] = [
            -e.group["lr"] * e.view.lr_scale(e.group["adjust_lr"]) for e in entries
        ]
        self.decay = [1.0 - e.group["lr"] * e.group["weight_decay"] for e in entries]
        self.cautious_decay = [
            e.group["lr"] * e.group["weight_decay"] if e.group["cautious_wd"] else 0.0
            for e in entries
        ]
        self._finite: list[tuple[tuple[str, ...], torch.Tensor]] = []
        # Transactional steps keep results per parameter (views of one parameter share a
        # buffer) and the pieces to apply, until commit().
        self._pending: dict[int, torch.Tensor] | None = {} if transactional else None
        self._replay: list[tuple[int, tuple[slice, ...]]] = []
        if not transactional:
            self._update_state()

    def _update_state(self) -> None:
        self._decay_and_accumulate(self.entries)
        self._magma(self.optimizer, self.entries)

    def commit(self) -> None:
        """Finish a transactional step: momentum, decay, Magma, then the kept updates."""
        if self._pending is None:
            raise RuntimeError("commit() finishes transactional steps only")
        self._update_state()
        for param, slices in self._replay:
            self._apply_now(param, slices, self._pending[id(self.params[param])][slices])

    def _decay_and_accumulate(self, entries: Sequence[_MuonParam]) -> None:
        """Momentum update (one pass per buffer) and decoupled weight decay (one foreach call
        per group), for the tensors whose reads or writes do not do it on the way.

        Cautious groups decay in :meth:`apply` instead, where the update's sign is known.
        """
        by_group: dict[int, list[int]] = {}
        seen: set[int] = set()
        for i, e in enumerate(entries):
            if id(e.param) not in seen:
                seen.add(id(e.param))
                by_group.setdefault(id(e.group), []).append(i)
        for indices in by_group.values():
            group = entries[indices[0]].group
            for i in indices:
                if i not in self.fused_reads:
                    advance_momentum(
                        self.grads[i], self.momenta[i], group["momentum"], self.momenta[i]
                    )
            decay = self.decay[indices[0]]
            decayed = [self.params[i] for i in indices if i not in self.fused_writes]
            if decay != 1.0 and decayed and not group["cautious_wd"]:
                torch._foreach_mul_(decayed, decay)

    def _magma(self, optimizer: Muon, entries: Sequence[_MuonParam]) -> None:
        """Damp Magma groups' updates per matrix by momentum-gradient agreement.

        Each rank sums dot products and squared norms of its rows per matrix; one all-reduce
        completes them, so every rank sees the cosine of the whole matrix. Replicas add a
        piece once per copy, which the cosine's ratio cancels.
        """
        by_param: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            if e.group["magma"]:
                by_param.setdefault(id(e.param), []).append(i)
        if not by_param:
            return
        row_maps, sums = [], []
        for indices in by_param.values():
            row_map = optimizer._row_matrices([entries[i] for i in indices])
            m, g = self.momenta[indices[0]].float(), self.grads[indices[0]].float()
            dims = tuple(range(1, m.ndim))
            per_row = torch.stack([(m * g).sum(dims), m.square().sum(dims), g.square().sum(dims)])
            count = optimizer.state[entries[indices[0]].param]["magma_score"].numel()
            total = torch.zeros(3, count, device=self.device).index_add_(1, row_map, per_row)
            row_maps.append(row_map)
            sums.append(total)
        totals = torch.cat(sums, dim=1)
        if self.holders.size > 1:
            dist.all_reduce(totals, group=self.holders.group)
        offset = 0
        for indices, row_map in zip(by_param.values(), row_maps, strict=True):
            e = entries[indices[0]]
            score = optimizer.state[e.param]["magma_score"]
            dot, mm, gg = totals[:, offset : offset + score.numel()]
            offset += score.numel()
            cosine = (dot / (mm.sqrt() * gg.sqrt()).clamp_min(_MAGMA_EPS)).clamp(-1.0, 1.0)
            beta = e.group["magma_beta"]
            score.mul_(beta).add_((1.0 + cosine) / 2.0, alpha=1.0 - beta)
            damping = (MAGMA_MIN_SCALE + (1.0 - MAGMA_MIN_SCALE) * score)[row_map]
            shape = (-1, *[1] * (self.params[indices[0]].ndim - 1))
            for i in indices:
                self.step_size[i] = (damping * self.step_size[i]).view(shape)

    def read_update(self, param: int, slices: tuple[slice, ...], out: torch.Tensor) -> None:
        grad, momentum = self.grads[param][slices], self.momenta[param][slices]
        mix = self.mix[param]
        if self._pending is not None or param in self.fused_reads:
            # Advance the momentum in this pass. A transactional step only commits it later,
            # so it reads the next value without storing it, as the commit will compute it.
            momentum_input_(
                grad, momentum, out, self.momentum[param], mix, store=self._pending is None
            )
        else:
            nesterov_input_(grad, momentum, out, mix)

    def apply(self, param: int, slices: tuple[slice, ...], ortho: torch.Tensor) -> None:
        # Owners add their own result in the dtype the other holders receive it in, so
        # replicas of a parameter round identically and stay bitwise equal.
        update = ortho.to(self.comm_dtype)
        if self._pending is None:
            self._apply_now(param, slices, update)
            return
        key = id(self.params[param])
        if key not in self._pending:
            self._pending[key] = torch.empty_like(self.params[param], dtype=self.comm_dtype)
        self._pending[key][slices].copy_(update)
        self._replay.append((param, slices))

    def _apply_now(self, param: int, slices: tuple[slice, ...], update: torch.Tensor) -> None:
        target = self.params[param][slices]
        step = self.step_size[param]
        if param in self.fused_writes:
            decay_and_update_(target, update, self.decay[param], cast(float, step))
            return
        decay = self.cautious_decay[param]
        if decay:
            # Cautious weight decay: only where sign(update) == sign(weight).
            target.sub_(target * (torch.sign(update) == torch.sign(target)), alpha=decay)
        if isinstance(step, torch.Tensor):
            target.add_(update * step[slices[0]])
        else:
            target.add_(update, alpha=step)

    def watch_finite(self, names: tuple[str, ...], result: torch.Tensor) -> None:
        # One reduction instead of an elementwise test: a sum is finite exactly when every
        # entry is, since Newton–Schulz entries are O(1) and cannot overflow it.
        self._finite.append((names, torch.isfinite(result.sum(dtype=torch.float32))))

    def nonfinite_results(self) -> list[str]:
        """Parameters of buckets with a non-finite Newton–Schulz result (one device sync)."""
        if not self._finite:
            return []
        flags = torch.stack([flag for _, flag in self._finite]).tolist()
        return sorted(
            {n for (names, _), ok in zip(self._finite, flags, strict=True) if not ok for n in names}
        )

    def orthogonalize(self, stack: torch.Tensor, ns_key: Hashable) -> torch.Tensor:
        steps, coefficients, parts, method = cast(
            tuple[int, Coefficients, PartSplit | None, str], ns_key
        )

        def run(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(
                x,
                steps=steps,
                coefficients=coefficients,
                dtype=self.ns_dtype,
                backend=self.backend,
                method=method,
            )

        return run(stack) if parts is None else parts.orthogonalize(stack, run)


def _ns_key(group: dict[str, Any], view: MatrixView) -> tuple[int, Hashable, PartSplit | None, str]:
    """What Newton–Schulz runs on a view's matrices: steps, coefficients, the parts the
    owner cuts each matrix into (with their lr scales), and the method. Groups loaded from a
    checkpoint saved before ``ns_method`` existed lack the key: "auto", its default."""
    coefficients = group["coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(tuple(float(v) for v in t) for t in coefficients)
    parts = view.part_split(group["adjust_lr"])
    return (group["ns_steps"], coefficients, parts, group.get("ns_method", "auto"))


def _split_by_algorithm(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Normalise the constructor's input to groups that each name their algorithm."""
    items = list(params)
    if not items:
        raise ValueError("Muon got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups: list[dict[str, Any]] = []
    for group in items:
        group = dict(group)
        raw = group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        if raw and isinstance(raw[0], tuple):
            group["param_names"] = [name for name, _ in raw]
            raw = [p for _, p in raw]
        group["params"] = raw
        if "algorithm" in group:
            groups.append(group)
            continue
        names = group.get("param_names")
        for algorithm, matrices in (("muon", True), ("adamw", False)):
            chosen = [i for i, p in enumerate(raw) if (p.ndim >= 2) == matrices]
            if not chosen:
                continue
            part = {**group, "algorithm": algorithm, "params": [raw[i] for i in chosen]}
            if algorithm == "adamw":
                part = {k: v for k, v in part.items() if k not in MUON_ONLY_KEYS}
            if names is not None:
                part["param_names"] = [names[i] for i in chosen]
            groups.append(part)
    return groups


def _matrix_count(group: dict[str, Any], p: torch.Tensor, name: str) -> int:
    """How many matrices a Muon parameter is cut into (Magma keeps one score each)."""
    return sum(v.count for v in matrix_views(p.shape, group, name))


def _state_shapes(group: dict[str, Any], p: torch.Tensor, name: str) -> dict[str, tuple[int, ...]]:
    """The state this optimizer keeps for ``p`` (besides AdamW's step), with shapes."""
    if group["algorithm"] == "adamw":
        return {"exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
    shapes = {"momentum_buffer": tuple(p.shape)}
    if group["magma"]:
        shapes["magma_score"] = (_matrix_count(group, p, name),)
    return shapes


def _with_names(saved: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
    """A saved group, named after the current group at its index when it lost its names
    (torchtitan's flat, name-keyed checkpoints come back without them) and sizes agree."""
    names = (current or {}).get("param_names")
    if "param_names" in saved or names is None or len(names) != len(saved["params"]):
        return saved
    return {**saved, "param_names": names}


def _check_saved_routing(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Name every parameter whose saved algorithm, state keys or state shapes differ from now."""
    saved_groups = [
        _with_names(saved, groups[i] if i < len(groups) else None)
        for i, saved in enumerate(state_dict.get("param_groups", []))
    ]
    saved = {
        name: (group.get("algorithm", "muon"), state_dict["state"].get(key, {}))
        for name, group, key in named_params(saved_groups)
    }
    current = {name: (group, p) for name, group, p in named_params(groups)}
    problems = [f"{name}: in the saved state, absent now" for name in saved if name not in current]
    for name, (group, p) in current.items():
        if name not in saved:
            problems.append(f"{name}: absent from the saved state")
            continue
        saved_algorithm, state = saved[name]
        algorithm = group["algorithm"]
        if saved_algorithm != algorithm:
            problems.append(f"{name}: saved as {saved_algorithm}, routed to {algorithm} now")
            continue
        shapes = _state_shapes(group, p, name)
        kept = set(state) - {"step"}
        if state and kept != set(shapes):
            problems.append(
                f"{name}: saved state has {sorted(kept)}, this optimizer keeps "
                f"{sorted(shapes)}; set magma as it was when saving"
            )
            continue
        for key, value in state.items():
            if key != "step" and tuple(value.shape) != shapes[key]:
                problems.append(
                    f"{name}: saved {key} has shape {tuple(value.shape)}, "
                    f"this optimizer keeps {shapes[key]}"
                )
    saved_sizes = [len(g["params"]) for g in state_dict.get("param_groups", [])]
    if not problems and saved_sizes != [len(g["params"]) for g in groups]:
        problems.append(f"param group sizes {saved_sizes} were saved; rebuild the same groups")
    if problems:
        raise ValueError(
            "the saved optimizer state does not match this optimizer's routing:\n  "
            + "\n  ".join(problems)
        )


def _validate_group(group: dict[str, Any], index: int) -> None:
    """Reject a bad option at construction, naming the key, the value and the choices."""
    where = f"param group {index} ({group['algorithm']})"
    if group["lr"] < 0:
        raise ValueError(f"{where}: lr={group['lr']!r} must be >= 0")
    if group["weight_decay"] < 0:
        raise ValueError(f"{where}: weight_decay={group['weight_decay']!r} must be >= 0")
    if group["algorithm"] == "adamw":
        beta1, beta2 = group["betas"]
        _check_range(f"{where}: betas[0]", beta1, 0.0, 1.0, closed_high=False)
        _check_range(f"{where}: betas[1]", beta2, 0.0, 1.0, closed_high=False)
        if group["eps"] < 0:
            raise ValueError(f"{where}: eps={group['eps']!r} must be >= 0")
        for key in MUON_ONLY_KEYS:
            if group.get(key) not in (None, False):
                raise ValueError(
                    f"{where}: {key}={group[key]!r} is a Muon option; set it on a group with "
                    "algorithm='muon' (valid keys here: lr, betas, eps, weight_decay)"
                )
        return
    _check_range(f"{where}: momentum", group["momentum"], 0.0, 1.0, closed_high=False)
    if group["adjust_lr"] not in ADJUST_LR:
        raise ValueError(
            f"{where}: adjust_lr={group['adjust_lr']!r} is not supported; choose one of {ADJUST_LR}"
        )
    if group["muon_mode"] not in MUON_MODES:
        raise ValueError(
            f"{where}: muon_mode={group['muon_mode']!r} is not supported; "
            f"choose one of {MUON_MODES}"
        )
    try:
        resolve_coefficients(group["coefficients"], group["ns_steps"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(
            f"{where}: ns_method={group['ns_method']!r} is not supported; choose one of "
            f"{list(NS_METHODS)}"
        )
    for key in ("magma", "cautious_wd"):
        if not isinstance(group[key], bool):
            raise ValueError(f"{where}: {key}={group[key]!r}; choose True or False")
    _check_range(f"{where}: magma_beta", group["magma_beta"], 0.0, 1.0, closed_high=False)
    for name, p in zip(group_param_names(group, index), group["params"], strict=True):
        matrix_views(p.shape, group, name=f"{where}: parameter {name!r}")
