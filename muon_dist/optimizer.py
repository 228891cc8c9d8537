"""The Muon optimizer: Muon for hidden matrices, AdamW for the rest, in one torch Optimizer.

This module builds and validates groups and orchestrates a step; the update rule lives in
:mod:`muon_dist.update_rule`, the Muon phase of a step in :mod:`muon_dist.muon_step`, the
device-side agreement on gradients in :mod:`muon_dist.agreement`, capture in
:mod:`muon_dist.cuda_graph`, and the rank and checkpoint checks in :mod:`muon_dist.checks`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as adamw_update

from muon_dist.agreement import Agreement, Outcome
from muon_dist.checks import check_ranks_agree, check_saved_routing, matrix_count
from muon_dist.cuda_graph import StepGraph
from muon_dist.groups import CommGroups, comm_groups
from muon_dist.kernels.coefficients import resolve_coefficients
from muon_dist.kernels.gram import METHODS as NS_METHODS
from muon_dist.muon_step import MuonEntry, MuonStep, ns_key
from muon_dist.plan import build_plan, layout_of, local
from muon_dist.qk_clip import MaxLogitTracker, QKClip, QKClipper
from muon_dist.routing import (
    ADJUST_LR,
    ALGORITHMS,
    MUON_MODES,
    format_routing_table,
    group_param_names,
    matrix_views,
    named_params,
    routing_entries,
)
from muon_dist.settings import ExecutionSettings

logger = logging.getLogger(__name__)

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
# Group entries that a captured step does not read from the group: the lr is staged into
# device memory every step, the rest is bookkeeping. Any other change is captured anew.
_NOT_CAPTURED = ("lr", "initial_lr", "params", "param_names", "steps", "skipped_steps")


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

    The step never waits for the device. All ranks agree on the device which gradients
    exist and are finite; a parameter without a gradient on any rank is left alone, and a
    non-finite gradient anywhere leaves every parameter and all state as they were. The
    host learns of it later, where it reads the step's flags: with CUDA tensors at the next
    ``step()``, ``state_dict()`` or :meth:`check_finite`; with CPU tensors at the end of the
    step itself. There ``nonfinite="raise"`` raises ``FloatingPointError`` naming the
    parameters and the step, and ``"skip_step"`` counts the step in ``skipped_steps`` and
    logs a warning. ``cuda_graph=True`` captures the whole step in a CUDA graph after
    ``graph_warmup`` eager steps and replays it (see :mod:`muon_dist.cuda_graph`).
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
        cuda_graph: bool = False,
        graph_warmup: int = 2,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.settings = ExecutionSettings(
            backend=backend,
            comm_dtype=comm_dtype,
            ns_dtype=ns_dtype,
            bucket_bytes=bucket_bytes,
            max_inflight=max_inflight,
            replica_mode=replica_mode,
            nonfinite=nonfinite,
            cuda_graph=cuda_graph,
            graph_warmup=graph_warmup,
        )
        muon_defaults: dict[str, Any] = {
            "algorithm": "muon",
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
        }
        self._defaults_by_algorithm: dict[str, dict[str, Any]] = {
            "muon": muon_defaults,
            "adamw": {
                "algorithm": "adamw",
                "lr": adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            },
        }
        self._runner: _StepRunner | None = None
        # What torch reads: its schedulers scale "lr" and cycle "momentum" (OneCycleLR,
        # CyclicLR), which is Muon's; AdamW groups keep their betas. Groups get their own
        # algorithm's defaults in add_param_group, never these.
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(_split_by_algorithm(params), defaults=defaults)
        self._comm = comm_groups(
            [p for g in self.param_groups for p in g["params"]], replica_mode, process_group
        )
        check_ranks_agree(
            self.param_groups,
            [repr(spec) for spec in qk_clip],
            self._comm.rank,
            self._comm.holders,
        )
        runner = self._step_runner()  # unsupported layouts fail here, not mid-training
        if cuda_graph and runner.device.type != "cuda":
            raise ValueError(
                f"cuda_graph=True captures CUDA work, and these parameters are on "
                f"{runner.device}; leave cuda_graph=False there (that path runs eagerly)"
            )
        if max_logits is not None and not qk_clip:
            raise ValueError("max_logits is only read by qk_clip; pass qk_clip=[QKClip(...)]")
        if qk_clip:
            clipper = QKClipper(
                qk_clip, max_logits, self._named_params(), self._comm.rank, self._comm.holders
            )
            self.register_step_post_hook(
                lambda opt, _args, _kwargs: clipper(opt._step_runner().agreement.found_inf)
            )
        logger.info("muon_dist.Muon routing:\n%s", self.routing_table())

    # -- construction -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm", "muon")
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm={algorithm!r} is not supported; choose one of {ALGORITHMS}"
            )
        group = {**self._defaults_by_algorithm[algorithm], **param_group}
        _validate_group(group, len(self.param_groups))
        group.setdefault("steps", 0)
        group.setdefault("skipped_steps", 0)
        # torch fills missing keys from ``defaults``, which are Muon's; this group already
        # holds its own algorithm's keys, and must not gain the other's.
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults
        self._runner = None
        names = group_param_names(group, len(self.param_groups) - 1)
        for p, name in zip(group["params"], names, strict=True):
            state = self.state[p]
            if algorithm == "muon":
                state["momentum_buffer"] = torch.zeros_like(p)
                if group["magma"]:
                    count = matrix_count(group, p, name)
                    state["magma_score"] = torch.ones(count, device=local(p).device)
            else:
                state["step"] = torch.tensor(0.0, device=local(p).device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)

    def state_dict(self) -> dict[str, Any]:
        """The state, after reading the last step's outcome (see :meth:`check_finite`)."""
        self.check_finite()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by Muon, refusing one whose routing no longer matches."""
        check_saved_routing(state_dict, self.param_groups)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        scores = {
            p: state_dict["state"][i]["magma_score"]
            for i, p in zip(saved_ids, params, strict=True)
            if "magma_score" in state_dict["state"].get(i, {})
        }
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts state to the parameter dtype and keeps AdamW's
        # step on the host; scores stay fp32 and steps live with the fused AdamW's tensors.
        for p, score in scores.items():
            self.state[p]["magma_score"] = score.to(local(p).device, torch.float32, copy=True)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                for p in group["params"]:
                    step = self.state[p]["step"]
                    self.state[p]["step"] = step.to(local(p).device, torch.float32, copy=True)
        if self._runner is not None:
            self._runner.bind_state(self.state)

    def routing_table(self) -> str:
        """Which parameter goes where, its matrix view and lr scale, as printable text."""
        return format_routing_table(routing_entries(self.param_groups))

    def _named_params(self) -> dict[str, torch.Tensor]:
        return {name: p for name, _, p in named_params(self.param_groups)}

    def _step_runner(self) -> _StepRunner:
        """The plan, bound tensors and device buffers of a step; built once per group set."""
        if self._runner is None:
            self._runner = _StepRunner(self.param_groups, self.state, self.settings, self._comm)
        return self._runner

    # -- step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step for every group (see the class docstring for gradients that are missing
        or non-finite, and for when the host learns of them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_finite()
        runner = self._step_runner()
        runner.run(self.param_groups)
        runner.agreement.queued(self.param_groups[0]["steps"] + 1)
        for group in self.param_groups:
            group["steps"] += 1
        if runner.agreement.on_host:
            self.check_finite()
        return loss

    def check_finite(self) -> None:
        """Read the last step's outcome and apply the ``nonfinite`` policy to it.

        On CUDA this waits for that step only (it was queued before this call, usually long
        before); ``step()`` and ``state_dict()`` call it first, so an explicit call is only
        needed to learn of a bad step before either.
        """
        if self._runner is None:
            return
        outcome = self._runner.agreement.read()
        if outcome is not None:
            self._report(outcome)

    def _report(self, outcome: Outcome) -> None:
        step = outcome.step
        if outcome.nonfinite_grads:
            reason = f"non-finite gradient in {', '.join(outcome.nonfinite_grads)}"
        else:
            reason = f"non-finite Newton–Schulz result for {', '.join(outcome.nonfinite_results)}"
        if self.settings.nonfinite == "skip_step":
            for group in self.param_groups:
                group["skipped_steps"] += 1
            logger.warning(
                "muon_dist.Muon: skipped step %d (%s); %d skipped so far",
                step,
                reason,
                self.param_groups[0]["skipped_steps"],
            )
            return
        if outcome.nonfinite_grads:
            raise FloatingPointError(
                f"muon_dist.Muon step {step}: {reason}; parameters and state were left as "
                "they were; fix the loss or pass nonfinite='skip_step' to skip such steps"
            )
        raise FloatingPointError(
            f"muon_dist.Muon step {step}: Newton–Schulz returned non-finite values for "
            f"{', '.join(outcome.nonfinite_results)} although every gradient was finite; "
            "either a momentum grew past a Frobenius norm of about 1.8e19 (lower the lr or "
            "clip gradients) or a kernel or device failed (try backend='torch'); those "
            "parameters were updated"
        )


class _StepRunner:
    """Everything a step repeats, built once: the Muon phase, the agreement, the staging of
    this step's hyper-parameters into device memory, and the CUDA graph when enabled."""

    def __init__(
        self,
        groups: Sequence[dict[str, Any]],
        state: dict[torch.Tensor, dict[str, Any]],
        settings: ExecutionSettings,
        comm: CommGroups,
    ) -> None:
        self.settings = settings
        named = list(named_params(groups))
        self.params = [p for _, _, p in named]
        self.device = local(self.params[0]).device
        group_index = {id(g): i for i, g in enumerate(groups)}
        entries: list[MuonEntry] = []
        muon_positions: list[int] = []
        for position, (name, group, p) in enumerate(named):
            if group["algorithm"] != "muon":
                continue
            first = 0
            for view in matrix_views(p.shape, group, name):
                entries.append(
                    MuonEntry(
                        p,
                        group,
                        view,
                        view.label(name),
                        first,
                        len(muon_positions),
                        group_index[id(group)],
                    )
                )
                first += view.count
            muon_positions.append(position)
        self.muon_positions = muon_positions
        self.muon: MuonStep | None = None
        if entries:
            layouts = [
                layout_of(e.param, e.name, e.view, comm.holders.ranks, ns_key(e.group, e.view))
                for e in entries
            ]
            plan = build_plan(
                layouts,
                comm.rank,
                comm.world_size,
                bucket_bytes=settings.bucket_bytes,
                itemsize=settings.comm_dtype.itemsize,
                replica_mode=settings.replica_mode,
                steps=[e.group["ns_steps"] for e in entries],
            )
            logger.debug("muon_dist: built a plan with %d buckets", len(plan.buckets))
            self.muon = MuonStep(plan, entries, state, settings, len(groups), comm)
        self.agreement = Agreement(
            [name for name, _, _ in named], muon_positions, self.device, comm.holders
        )
        # Per AdamW group, its parameters' positions; their local tensors, set by bind_state.
        self._adamw_members: dict[int, list[int]] = {}
        for position, (_, group, _) in enumerate(named):
            if group["algorithm"] == "adamw":
                self._adamw_members.setdefault(group_index[id(group)], []).append(position)
        self.group_count = len(groups)
        self.hyper = torch.zeros(2 * len(groups) + len(self.params), device=self.device)
        # AdamW reads its lr from device memory on CUDA (fused AdamW takes a tensor lr).
        self._lr_views = list(self.hyper[: len(groups)].unbind(0))
        self.graph = StepGraph(settings.graph_warmup) if settings.cuda_graph else None
        self._grads: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [
            (None, None) for _ in self.params
        ]
        self.bind_state(state)

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the state tensors (again after a state load, which replaces them)."""
        self.state = state
        self._adamw_tensors = {
            i: (
                local(p),
                local(state[p]["exp_avg"]),
                local(state[p]["exp_avg_sq"]),
                state[p]["step"],
            )
            for members in self._adamw_members.values()
            for i in members
            for p in (self.params[i],)
        }
        if self.muon is not None:
            self.muon.bind_state(state)
        if self.graph is not None:
            self.graph.reset()

    def _local_grads(self) -> list[torch.Tensor | None]:
        """Local gradient shards; a gradient kept between steps is unwrapped only once."""
        grads: list[torch.Tensor | None] = []
        for index, p in enumerate(self.params):
            grad = p.grad
            source, unwrapped = self._grads[index]
            if grad is not source:
                unwrapped = None if grad is None else local(grad)
                self._grads[index] = (grad, unwrapped)
            grads.append(unwrapped)
        return grads

    def run(self, groups: Sequence[dict[str, Any]]) -> None:
        grads = self._local_grads()
        values = [float(g["lr"]) for g in groups] + [float(g["weight_decay"]) for g in groups]
        values += [0.0 if g is None else 1.0 for g in grads]
        pinned = self.device.type == "cuda"
        staged = torch.tensor(values, dtype=torch.float32, pin_memory=pinned)
        self.hyper.copy_(staged, non_blocking=pinned)

        def body() -> None:
            self._body(groups, grads)

        if self.graph is None:
            body()
            return
        if any(g is None for g in grads):
            missing = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(
                f"cuda_graph=True: {len(missing)} parameters have no gradient this step; a "
                "captured step reads every gradient tensor in place, so keep them between "
                "steps with zero_grad(set_to_none=False), or use cuda_graph=False"
            )
        key = (tuple((k, repr(v)) for g in groups for k, v in g.items() if k not in _NOT_CAPTURED),)
        self.graph.run(body, key, grads)

    def _body(self, groups: Sequence[dict[str, Any]], grads: Sequence[torch.Tensor | None]) -> None:
        """The device work of one step: everything a captured step replays."""
        agreement = self.agreement
        agreement.decide(grads, self.hyper[2 * self.group_count :])
        skip = self.settings.nonfinite == "skip_step"
        if self.muon is not None:
            self.muon.run(
                [grads[i] for i in self.muon_positions],
                agreement.keep,
                agreement.found_inf,
                agreement.ns_bad,
                self.hyper,
                lambda: agreement.agree_on_results(skip),
                transactional=skip,
            )
        for index, group in enumerate(groups):
            if group["algorithm"] == "adamw":
                self._adamw(group, index, grads)
        agreement.publish()

    def _adamw(
        self, group: dict[str, Any], index: int, grads: Sequence[torch.Tensor | None]
    ) -> None:
        members = [i for i in self._adamw_members[index] if grads[i] is not None]
        if not members:
            return
        tensors = self._adamw_tensors
        beta1, beta2 = group["betas"]
        cuda = self.device.type == "cuda"
        adamw_update(
            [tensors[i][0] for i in members],
            [cast(torch.Tensor, grads[i]) for i in members],
            [tensors[i][1] for i in members],
            [tensors[i][2] for i in members],
            [],
            [tensors[i][3] for i in members],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=self._lr_views[index] if cuda else group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            found_inf=self.agreement.found_inf,
        )


def _check_range(name: str, value: float, low: float, high: float, *, closed_high: bool) -> None:
    ok = low <= value <= high if closed_high else low <= value < high
    if not ok:
        bracket = "]" if closed_high else ")"
        raise ValueError(
            f"{name}={value!r} is out of range; it must lie in [{low}, {high}{bracket}"
        )


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
