"""The Muon optimizer: Muon for hidden matrices, AdamW for the rest, in one torch Optimizer.

This module builds and validates groups and orchestrates a step; the update rule lives in
:mod:`muon_dist.update_rule`, the Muon phase of a step in :mod:`muon_dist.muon_step`, the
device-side agreement on gradients in :mod:`muon_dist.agreement`, capture in
:mod:`muon_dist.cuda_graph`, and the rank and checkpoint checks in :mod:`muon_dist.checks`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as adamw_update

from muon_dist.agreement import Agreement, Outcome
from muon_dist.checks import (
    by_name,
    check_grad,
    check_ranks_agree,
    check_saved_routing,
    matrix_count,
)
from muon_dist.cuda_graph import StepGraph
from muon_dist.flat import zeros_like_flat
from muon_dist.grouping import algorithm_by_name
from muon_dist.groups import CommGroups, comm_groups
from muon_dist.muon_step import MuonEntry, MuonStep, ns_key
from muon_dist.plan import build_plan, layout_of, local
from muon_dist.qk_clip import MaxLogitTracker, QKClip, QKClipper
from muon_dist.routing import (
    ALGORITHMS,
    format_routing_table,
    group_param_names,
    matrix_views,
    named_params,
    routing_entries,
)
from muon_dist.settings import ExecutionSettings
from muon_dist.validation import check_group_keys, validate_group

logger = logging.getLogger(__name__)

# Newton–Schulz divides its input by the Frobenius norm, whose square overflows fp32 above
# about 1.84e19 (3.4e38 ** 0.5); the limit leaves room for Polar Express's 1.02 factor.
NS_NORM_LIMIT = 1.8e19 / 1.02
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
    exist and are finite; a parameter without a gradient on any rank is left alone, one
    without a gradient on some ranks takes a zero gradient there (Muon and AdamW alike), and
    a non-finite gradient anywhere leaves every parameter and all state as they were. The
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
        groups = _split_by_algorithm(params, self._defaults_by_algorithm)
        # A group refused on this rank only (options that differ across ranks) is agreed
        # through the rank check below, so the other ranks raise too instead of waiting.
        refused: ValueError | TypeError | None = None
        try:
            super().__init__(groups, defaults=defaults)
        except (ValueError, TypeError) as exc:
            refused = exc
        self._comm = comm_groups(
            [p for g in groups for p in g["params"]], replica_mode, process_group
        )
        try:
            check_ranks_agree(
                [] if refused else self.param_groups,
                [f"refused: {refused}"] if refused else [repr(spec) for spec in qk_clip],
                self._comm.rank,
                self._comm.holders,
            )
        except RuntimeError:
            if refused is None:
                raise
        if refused is not None:
            raise refused
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
        defaults_of = self._defaults_by_algorithm[algorithm]
        where = f"param group {len(self.param_groups)} ({algorithm})"
        other = "adamw" if algorithm == "muon" else "muon"
        check_group_keys(param_group, defaults_of, self._defaults_by_algorithm[other], where)
        group = {**defaults_of, **param_group}
        validate_group(group, len(self.param_groups))
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
        # One buffer holds the group's momenta, so the step stores them in one pass.
        momenta = zeros_like_flat(group["params"]) if algorithm == "muon" else []
        for index, (p, name) in enumerate(zip(group["params"], names, strict=True)):
            state = self.state[p]
            if algorithm == "muon":
                state["momentum_buffer"] = momenta[index]
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
        """Load a state saved by Muon, matching parameters by name, refusing one whose routing
        no longer matches and checking every loaded option as the constructor does."""
        self.check_finite()  # the last step's outcome, before its step is rebuilt below
        check_saved_routing(state_dict, self.param_groups)
        state_dict = by_name(state_dict, self.param_groups)
        for index, (saved, group) in enumerate(
            zip(state_dict["param_groups"], self.param_groups, strict=True)
        ):
            options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            validate_group({**group, **options}, index)
        params = [p for g in self.param_groups for p in g["params"]]
        scores = {
            p: state_dict["state"][i]["magma_score"]
            for i, p in enumerate(params)
            if "magma_score" in state_dict["state"].get(i, {})
        }
        momenta: dict[torch.Tensor, torch.Tensor] = {}
        for i, (name, group, p) in enumerate(named_params(self.param_groups)):
            saved = state_dict["state"].get(i, {}).get("momentum_buffer")
            if group["algorithm"] != "muon" or saved is None:
                continue
            buffer = local(self.state[p]["momentum_buffer"])
            if local(saved).shape != buffer.shape:
                raise ValueError(
                    f"load_state_dict: the momentum of {name!r} holds a local shard of shape "
                    f"{tuple(local(saved).shape)}, where this rank's shard of the parameter is "
                    f"{tuple(buffer.shape)}; load a state saved on the same mesh, or go "
                    "through torch.distributed.checkpoint, which reshards"
                )
            momenta[p] = self.state[p]["momentum_buffer"]
        super().load_state_dict(state_dict)
        # Loaded values go into the group's buffer (see add_param_group), not beside it.
        for p, buffer in momenta.items():
            loaded = local(self.state[p]["momentum_buffer"])
            if loaded.data_ptr() != local(buffer).data_ptr():
                local(buffer).copy_(loaded)
            self.state[p]["momentum_buffer"] = buffer
        # Optimizer.load_state_dict casts state to the parameter dtype and keeps AdamW's
        # step on the host; scores stay fp32 and steps live with the fused AdamW's tensors.
        for p, score in scores.items():
            self.state[p]["magma_score"] = score.to(local(p).device, torch.float32, copy=True)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                for p in group["params"]:
                    step = self.state[p]["step"]
                    self.state[p]["step"] = step.to(local(p).device, torch.float32, copy=True)
        # Optimizer.load_state_dict replaces the group dicts, which the step reads its
        # momentum, Nesterov and lr scale from: bind a step to the loaded groups.
        self._runner = None
        self._step_runner()

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
        """One step for every group.

        The principle: every rank reaches the same outcome (the same exception, or the same
        successful update), and a step that fails leaves parameters and optimizer state as
        they were. Options were checked at construction and load; here each rank checks its
        gradients against their parameters, then all ranks agree on the device, in the
        step's one all-reduce, which gradients exist, which are non-finite or too large to
        normalise, and whether some rank refused its inputs. Any of these makes every rank
        keep everything as it was, without a host branch and so also in a captured step. A
        rank that refused its inputs raises its error here; the others raise
        ``RuntimeError`` naming it, and a bad gradient raises ``FloatingPointError`` (or is
        skipped), where the host reads the outcome (see the class docstring). An exception
        from Newton–Schulz on one rank is agreed the same way, through the all-reduce of
        the result flags. What is not agreed: any other exception inside one rank's step,
        or a rank that dies; the others then wait in the next collective until the process
        group's timeout raises there (see the README's Reliability section). Under
        ``nonfinite="raise"`` a non-finite Newton–Schulz result of finite inputs, or its
        exception, is raised on every rank after the rest of the update was applied;
        ``"skip_step"`` keeps everything as it was instead.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_finite()
        runner = self._step_runner()
        failure = runner.run(self.param_groups)
        runner.agreement.queued(self.param_groups[0]["steps"] + 1)
        for group in self.param_groups:
            group["steps"] += 1
        if failure is not None:
            runner.agreement.discard()
            raise failure
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
        if outcome.crashed_rank is not None:
            kept = (
                "parameters and state were left as they were on every rank"
                if self.settings.nonfinite == "skip_step"
                else "under nonfinite='raise' the rest of the step was applied and the failed "
                "matrices may be partly updated ('skip_step' leaves everything as it was)"
            )
            raise RuntimeError(
                f"muon_dist.Muon step {step} failed on rank {outcome.crashed_rank}: its "
                "Newton–Schulz or the read or write of an update raised an exception (raised "
                f"there, with its traceback); {kept}"
            )
        if outcome.failed_rank is not None:
            raise RuntimeError(
                f"muon_dist.Muon step {step} failed on rank {outcome.failed_rank}, which "
                "refused its inputs and raised an error naming them; parameters and state "
                "were left as they were on every rank; fix that rank's inputs"
            )
        if outcome.nonfinite_grads:
            reason = f"non-finite gradient in {', '.join(outcome.nonfinite_grads)}"
        elif outcome.overflowing_grads:
            reason = (
                f"gradient norm too large in {', '.join(outcome.overflowing_grads)} (finite, "
                f"but above {NS_NORM_LIMIT:.2g}·(1 - momentum), where Newton–Schulz's "
                "normalisation would overflow fp32)"
            )
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
        if outcome.nonfinite_grads or outcome.overflowing_grads:
            raise FloatingPointError(
                f"muon_dist.Muon step {step}: {reason}; parameters and state were left as "
                "they were; fix the loss (or clip gradients) or pass nonfinite='skip_step' "
                "to skip such steps"
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
        self.names = [name for name, _, _ in named]
        self._group_of = [group_index[id(group)] for _, group, _ in named]
        self.rank = comm.rank
        # lr and weight decay per group | presence and norm limit per parameter | failure
        self.hyper = torch.zeros(2 * len(groups) + 2 * len(self.params) + 1, device=self.device)
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
        """Local gradient shards; a gradient kept between steps is checked and unwrapped
        only once."""
        grads: list[torch.Tensor | None] = []
        for index, p in enumerate(self.params):
            grad = p.grad
            source, unwrapped = self._grads[index]
            if grad is not source:
                unwrapped = None if grad is None else check_grad(self.names[index], p, grad)
                self._grads[index] = (grad, unwrapped)
            grads.append(unwrapped)
        return grads

    def run(self, groups: Sequence[dict[str, Any]]) -> Exception | None:
        """Queue one step. A rank that refuses its inputs (a gradient of the wrong layout,
        a sparse one, a missing one under capture) still takes part in the step's agreement,
        with every gradient absent and its failure flagged, so every rank leaves everything
        as it was and learns of the failure; it returns its error for the caller to raise.
        """
        failure: Exception | None = None
        try:
            grads = self._local_grads()
            if self.graph is not None:
                _check_captured(grads)
        except (TypeError, ValueError, RuntimeError) as exc:
            failure = exc
            grads = [None] * len(self.params)
        values = [float(g["lr"]) for g in groups] + [float(g["weight_decay"]) for g in groups]
        values += [0.0 if g is None else 1.0 for g in grads]
        limits = [_norm_limit(g) for g in groups]
        values += [limits[g] for g in self._group_of]
        values.append(0.0 if failure is None else float(self.rank + 1))
        pinned = self.device.type == "cuda"
        staged = torch.tensor(values, dtype=torch.float32, pin_memory=pinned)
        self.hyper.copy_(staged, non_blocking=pinned)
        if self.graph is None or failure is not None:
            self._body(groups, grads)
            return failure or self._crash()

        def body() -> None:
            self._body(groups, grads)

        key = (tuple((k, repr(v)) for g in groups for k, v in g.items() if k not in _NOT_CAPTURED),)
        self.graph.run(body, key, grads)
        return self._crash()

    def _crash(self) -> Exception | None:
        """The exception Newton–Schulz raised on this rank in the step just queued."""
        return None if self.muon is None else self.muon.error

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
        """AdamW for one group. A parameter without a local gradient takes a zero one where
        another rank has a gradient, as a Muon parameter does, so replicas and step counts
        stay equal: one launch each, skipped on the device where no rank has a gradient."""
        members = self._adamw_members[index]
        present = [i for i in members if grads[i] is not None]
        if present:
            self._adamw_launch(group, index, present, grads, self.agreement.found_inf)
        for i in members:
            if grads[i] is None:
                skip = torch.maximum(self.agreement.found_inf, 1.0 - self.agreement.flags[i])
                zero = torch.zeros_like(self._adamw_tensors[i][0])
                self._adamw_launch(group, index, [i], {i: zero}, skip)

    def _adamw_launch(
        self,
        group: dict[str, Any],
        index: int,
        members: Sequence[int],
        grads: Sequence[torch.Tensor | None] | dict[int, torch.Tensor],
        found_inf: torch.Tensor,
    ) -> None:
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
            found_inf=found_inf,
        )


def _check_captured(grads: Sequence[torch.Tensor | None]) -> None:
    missing = [i for i, g in enumerate(grads) if g is None]
    if missing:
        raise RuntimeError(
            f"cuda_graph=True: {len(missing)} parameters have no gradient this step; a "
            "captured step reads every gradient tensor in place, so keep them between "
            "steps with zero_grad(set_to_none=False), or use cuda_graph=False"
        )


def _norm_limit(group: dict[str, Any]) -> float:
    """The largest gradient norm a Muon parameter of ``group`` takes: its momentum stays
    below ``norm / (1 - momentum)``, and Newton–Schulz's input must stay below
    :data:`NS_NORM_LIMIT`. AdamW parameters have none."""
    if group["algorithm"] != "muon":
        return math.inf
    return NS_NORM_LIMIT * (1.0 - float(group["momentum"]))


def _split_by_algorithm(
    params: Iterable[Any], defaults_by_algorithm: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Normalise the constructor's input to groups that each name their algorithm.

    A group without an algorithm is split: by name where its parameters are named
    (``named_parameters()``, ``param_names``), as :func:`muon_dist.grouping.algorithm_by_name`
    routes them, else >=2-D parameters to Muon and the rest to AdamW, with a warning (an
    embedding or head would go to Muon). Each part keeps the keys the other algorithm's part
    alone reads out of it (a Muon part drops ``betas``, an AdamW part ``momentum``)."""
    items = list(params)
    if not items:
        raise ValueError("Muon got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups: list[dict[str, Any]] = []
    unnamed = False
    tensors: list[str] = []  # named >2-D parameters sent to AdamW
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
        if names is not None:
            mode = group.get("muon_mode", defaults_by_algorithm["muon"]["muon_mode"])
            routes = [algorithm_by_name(n, p, mode) for n, p in zip(names, raw, strict=True)]
            tensors += [
                n
                for n, p, r in zip(names, raw, routes, strict=True)
                if p.ndim > 2 and r[0] == "adamw"
            ]
        else:
            unnamed = unnamed or any(p.ndim >= 2 for p in raw)
            routes = [("muon" if p.ndim >= 2 else "adamw", False) for p in raw]
        for route in dict.fromkeys(routes):
            algorithm, stacked = route
            chosen = [i for i, r in enumerate(routes) if r == route]
            other = "adamw" if algorithm == "muon" else "muon"
            foreign = set(defaults_by_algorithm[other]) - set(defaults_by_algorithm[algorithm])
            part = {k: v for k, v in group.items() if k not in foreign}
            part.update(algorithm=algorithm, params=[raw[i] for i in chosen])
            if stacked:
                part["experts"] = True
            if names is not None:
                part["param_names"] = [names[i] for i in chosen]
            groups.append(part)
    if tensors:
        logger.warning(
            "muon_dist.Muon routed %s (>2-D, neither convolutions nor expert stacks by name "
            "alone) to AdamW; pass muon_mode='flat' or 'slice' to orthogonalize them, or build "
            "groups with muon_dist.param_groups(model), which reads their modules",
            ", ".join(tensors),
        )
    if unnamed:
        logger.warning(
            "muon_dist.Muon got parameters without names or 'algorithm' (as transformers' "
            "Trainer passes them with optimizer_cls_and_kwargs=(Muon, ...)): every >= 2-D "
            "parameter goes to Muon, embeddings and output heads included. Pass "
            "muon_dist.param_groups(model), or model.named_parameters() to route by name; "
            "with the Trainer, optimizer_cls_and_kwargs=(muon_dist.integrations.hf_trainer."
            "MuonFactory, {...})"
        )
    return groups
