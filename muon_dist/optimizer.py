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

from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.dispatch import newton_schulz, validate_backend
from muon_dist.plan import REPLICA_MODES, Plan, build_plan, layout_of
from muon_dist.routing import (
    ADJUST_LR,
    ALGORITHMS,
    MUON_MODES,
    MatrixView,
    format_routing_table,
    group_param_names,
    matrix_view,
    routing_entries,
)
from muon_dist.runtime import run_tasks
from muon_dist.runtime.bucket_task import bucket_task

logger = logging.getLogger(__name__)

# Group keys that change how parameters are cut into matrices or scheduled: a change rebuilds
# the plan. Hyper-parameters such as lr are read fresh every step instead.
_PLAN_KEYS = ("muon_mode", "experts", "num_experts", "ns_steps", "coefficients")
_MAX_CACHED_PLANS = 8
NONFINITE_POLICIES = ("raise", "skip_step")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_range(name: str, value: float, low: float, high: float, *, closed_high: bool) -> None:
    ok = low <= value <= high if closed_high else low <= value < high
    if not ok:
        bracket = "]" if closed_high else ")"
        raise ValueError(
            f"{name}={value!r} is out of range; it must lie in [{low}, {high}{bracket}"
        )


@dataclass
class _MuonParam:
    """Per-step handles of one Muon parameter, in plan order."""

    param: torch.Tensor
    group: dict[str, Any]
    view: MatrixView
    name: str


class Muon(torch.optim.Optimizer):
    """Distributed Muon with AdamW for non-matrix parameters.

    Groups carry ``"algorithm": "muon" | "adamw"``; a group without it is split, >=2-D
    parameters to Muon and the rest to AdamW. Muon parameters may be plain tensors or
    DTensors on any mesh (FSDP2, HSDP, expert or tensor parallel): whole matrices are
    gathered onto one owner rank each, orthogonalized there, and scattered back, so the
    update equals single-device Muon.
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
        comm_dtype: torch.dtype = torch.bfloat16,
        *,
        muon_mode: str = "2d",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        bucket_bytes: int = 128 * 2**20,
        max_inflight: int = 2,
        replica_mode: str = "split",
        ns_dtype: torch.dtype = torch.bfloat16,
        nonfinite: str = "raise",
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
                "muon_mode": muon_mode,
                "experts": False,
                "num_experts": None,
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
        self._plans: dict[Hashable, Plan] = {}
        super().__init__(_split_by_algorithm(params), defaults={})
        self._check_ranks_agree()
        entries = self._muon_params()
        if entries:
            self._get_plan(entries)  # unsupported layouts fail here, not mid-training
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
        for p in group["params"]:
            state = self.state[p]
            if algorithm == "muon":
                state["momentum_buffer"] = torch.zeros_like(p)
            else:
                fused = local(p).is_cuda
                state["step"] = torch.tensor(0.0, device=local(p).device if fused else None)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by Muon, refusing one whose routing no longer matches."""
        _check_saved_routing(state_dict, self.param_groups)
        super().load_state_dict(state_dict)

    def routing_table(self) -> str:
        """Which parameter goes where, its matrix view and lr scale, as printable text."""
        return format_routing_table(routing_entries(self.param_groups))

    def _check_ranks_agree(self) -> None:
        """Fail fast, instead of hanging in a collective, when ranks hold different params."""
        rank, world_size = _distributed()
        if world_size == 1:
            return
        lines = []
        for g_index, group in enumerate(self.param_groups):
            options = {k: group.get(k) for k in ("algorithm", *_PLAN_KEYS)}
            for name, p in zip(group_param_names(group, g_index), group["params"], strict=True):
                placements = p.placements if isinstance(p, DTensor) else "plain"
                mesh = tuple(p.device_mesh.shape) if isinstance(p, DTensor) else ()
                lines.append(f"{name} {tuple(p.shape)} {p.dtype} {placements} {mesh} {options}")
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        digests: list[str | None] = [None] * world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) == 1:
            return
        all_lines: list[list[str] | None] = [None] * world_size
        dist.all_gather_object(all_lines, lines)
        reference = all_lines[0] or []
        for other, other_lines in enumerate(all_lines):
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
                f"muon_dist.Muon: rank {other} built a different parameter list than rank 0 "
                f"(this is rank {rank}); rank 0 has {len(reference)} params, rank {other} has "
                f"{len(other_lines)}; first difference at entry {diff[0]}: rank 0 {diff[1]!r} vs "
                f"rank {other} {diff[2]!r}. Build the model and param groups identically on "
                "every rank."
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
        if nonfinite:
            step = self.param_groups[0]["steps"] + 1
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"muon_dist.Muon step {step}: non-finite gradient in {', '.join(nonfinite)}; "
                    "fix the loss or pass nonfinite='skip_step' to skip such steps"
                )
            for group in self.param_groups:
                group["skipped_steps"] += 1
                group["steps"] += 1
            logger.warning(
                "muon_dist.Muon: skipped step %d (non-finite gradient in %s); %d skipped so far",
                step,
                ", ".join(nonfinite),
                self.param_groups[0]["skipped_steps"],
            )
            return loss
        for group in self.param_groups:
            group["steps"] += 1
            if group["algorithm"] == "adamw":
                self._adamw_group_step(group)
        self._muon_step([e for e in muon if present[id(e.param)]])
        return loss

    def _agree_on_gradients(self) -> tuple[dict[int, bool], list[str]]:
        """Which parameters have a gradient on some rank, and which have a non-finite one.

        One small all-reduce answers both, so ranks take identical decisions and their
        collectives stay matched. A Muon parameter with a gradient on some ranks only (an
        expert no local token reached) then takes part everywhere, with zeros where absent.
        """
        named: list[tuple[str, torch.Tensor]] = []
        for g_index, group in enumerate(self.param_groups):
            named += zip(group_param_names(group, g_index), group["params"], strict=True)
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
        _, world_size = _distributed()
        if world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
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
        for g_index, group in enumerate(self.param_groups):
            if group["algorithm"] != "muon":
                continue
            for name, p in zip(group_param_names(group, g_index), group["params"], strict=True):
                view = matrix_view(
                    p.shape,
                    muon_mode=group["muon_mode"],
                    experts=group["experts"],
                    num_experts=group["num_experts"],
                    name=name,
                )
                out.append(_MuonParam(p, group, view, name))
        return out

    def _get_plan(self, entries: Sequence[_MuonParam]) -> Plan:
        rank, world_size = _distributed()
        key = (
            rank,
            world_size,
            self.bucket_bytes,
            self.replica_mode,
            self.comm_dtype,
            tuple((id(e.param), e.view, tuple(e.group[k] for k in _PLAN_KEYS)) for e in entries),
        )
        plan = self._plans.get(key)
        if plan is None:
            layouts = [
                layout_of(e.param, e.name, e.view, world_size, _ns_key(e.group)) for e in entries
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
            self._plans[key] = plan
            logger.debug("muon_dist: built a plan with %d buckets", len(plan.buckets))
        return plan

    def _muon_step(self, entries: list[_MuonParam]) -> None:
        if not entries:
            return
        _, world_size = _distributed()
        context = _StepContext(self, entries, world_size)
        plan = self._get_plan(entries)
        run_tasks((bucket_task(b, context) for b in plan.buckets), self.max_inflight)
        broken = context.nonfinite_results()
        if broken:
            raise FloatingPointError(
                "muon_dist.Muon: Newton–Schulz returned non-finite values for "
                f"{', '.join(broken)} although every gradient was finite; this points at a "
                "kernel or device fault (try backend='torch'); those parameters were updated"
            )


class _StepContext:
    """Local tensors and hyper-parameters of one step, indexed by plan position."""

    def __init__(self, optimizer: Muon, entries: Sequence[_MuonParam], world_size: int) -> None:
        self.world_size = world_size
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
        self.mix = [e.group["momentum"] if e.group["nesterov"] else None for e in entries]
        self.step_size = [-e.group["lr"] * e.view.lr_scale(e.group["adjust_lr"]) for e in entries]
        self._finite: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self._decay_and_accumulate(entries)

    def _decay_and_accumulate(self, entries: Sequence[_MuonParam]) -> None:
        """Momentum update and decoupled weight decay, one foreach call per group."""
        by_group: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_group.setdefault(id(e.group), []).append(i)
        for indices in by_group.values():
            group = entries[indices[0]].group
            momenta = [self.momenta[i] for i in indices]
            torch._foreach_mul_(momenta, group["momentum"])
            torch._foreach_add_(momenta, [self.grads[i] for i in indices])
            decay = 1.0 - group["lr"] * group["weight_decay"]
            if decay != 1.0:
                torch._foreach_mul_([self.params[i] for i in indices], decay)

    def read_update(self, param: int, slices: tuple[slice, ...]) -> torch.Tensor:
        mix = self.mix[param]
        if mix is None:
            return self.momenta[param][slices]
        return torch.add(self.grads[param][slices], self.momenta[param][slices], alpha=mix)

    def apply(self, param: int, slices: tuple[slice, ...], ortho: torch.Tensor) -> None:
        # Owners add their own result in the dtype the other holders receive it in, so
        # replicas of a parameter round identically and stay bitwise equal.
        self.params[param][slices].add_(ortho.to(self.comm_dtype), alpha=self.step_size[param])

    def watch_finite(self, names: tuple[str, ...], result: torch.Tensor) -> None:
        self._finite.append((names, torch.isfinite(result).all()))

    def nonfinite_results(self) -> list[str]:
        """Parameters of buckets with a non-finite Newton–Schulz result (one device sync)."""
        if not self._finite:
            return []
        flags = torch.stack([flag for _, flag in self._finite]).tolist()
        return sorted(
            {n for (names, _), ok in zip(self._finite, flags, strict=True) if not ok for n in names}
        )

    def orthogonalize(self, stack: torch.Tensor, ns_key: Hashable) -> torch.Tensor:
        steps, coefficients = cast(tuple[int, Coefficients], ns_key)
        return newton_schulz(
            stack, steps=steps, coefficients=coefficients, dtype=self.ns_dtype, backend=self.backend
        )


def _ns_key(group: dict[str, Any]) -> tuple[int, Hashable]:
    coefficients = group["coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(tuple(float(v) for v in t) for t in coefficients)
    return (group["ns_steps"], coefficients)


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
        for algorithm, keep in (("muon", lambda p: p.ndim >= 2), ("adamw", lambda p: p.ndim < 2)):
            chosen = [i for i, p in enumerate(raw) if keep(p)]
            if not chosen:
                continue
            part = {**group, "algorithm": algorithm, "params": [raw[i] for i in chosen]}
            if names is not None:
                part["param_names"] = [names[i] for i in chosen]
            groups.append(part)
    return groups


_STATE_KEYS = {"muon": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}


def _check_saved_routing(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Name every parameter whose saved algorithm or state shape differs from now."""
    saved: dict[str, tuple[str, dict[str, Any]]] = {}
    for g_index, group in enumerate(state_dict.get("param_groups", [])):
        names = group_param_names(group, g_index)
        for name, key in zip(names, group["params"], strict=True):
            saved[name] = (group.get("algorithm", "muon"), state_dict["state"].get(key, {}))
    current: dict[str, tuple[str, torch.Tensor]] = {}
    for g_index, group in enumerate(groups):
        for name, p in zip(group_param_names(group, g_index), group["params"], strict=True):
            current[name] = (group["algorithm"], p)
    problems = [f"{name}: in the saved state, absent now" for name in saved if name not in current]
    for name, (algorithm, p) in current.items():
        if name not in saved:
            problems.append(f"{name}: absent from the saved state")
            continue
        saved_algorithm, state = saved[name]
        if saved_algorithm != algorithm or (state and set(state) != _STATE_KEYS[algorithm]):
            problems.append(f"{name}: saved as {saved_algorithm}, routed to {algorithm} now")
            continue
        for key, value in state.items():
            if key != "step" and tuple(value.shape) != tuple(p.shape):
                problems.append(
                    f"{name}: saved {key} has shape {tuple(value.shape)}, "
                    f"the parameter has {tuple(p.shape)}"
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
    for name, p in zip(group_param_names(group, index), group["params"], strict=True):
        matrix_view(
            p.shape,
            muon_mode=group["muon_mode"],
            experts=group["experts"],
            num_experts=group["num_experts"],
            name=f"{where}: parameter {name!r}",
        )
