"""The Muon optimizer: Muon for hidden matrices, AdamW for the rest, in one torch Optimizer.

This module is the torch-facing shell: construction, validation, param groups,
``state_dict`` and hooks. What a step computes lives in :mod:`muon_dist.update_rule`; the
step machinery in :mod:`muon_dist.step_runner` (and the Muon phase it runs,
:mod:`muon_dist.muon_phase`), the device-side agreement on gradients in
:mod:`muon_dist.agreement`, capture in :mod:`muon_dist.cuda_graph`, and the rank and
checkpoint checks in :mod:`muon_dist.checks`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.agreement import Outcome
from muon_dist.backward_start import register_grad_hooks
from muon_dist.checks import by_name, check_ranks_agree, check_saved_routing, matrix_count
from muon_dist.flat import zeros_like_flat
from muon_dist.groups import comm_groups, dedicated
from muon_dist.qk_clip import MaxLogitTracker, QKClip, QKClipper
from muon_dist.routing import (
    ALGORITHMS,
    format_routing_table,
    group_param_names,
    named_params,
    routing_entries,
)
from muon_dist.settings import ExecutionSettings
from muon_dist.step_runner import StepRunner
from muon_dist.step_scalars import NS_NORM_LIMIT
from muon_dist.tensors import local
from muon_dist.validation import check_group_keys, validate_group

logger = logging.getLogger(__name__)


class Muon(torch.optim.Optimizer):
    r"""Distributed Muon with AdamW for non-matrix parameters.

    For each matrix :math:`W` of a Muon group (gradient :math:`G`, momentum :math:`M`,
    Newton–Schulz :math:`\mathrm{NS}`), one step computes
    (:func:`muon_dist.update_rule.muon_update_`)

    .. math::
        \begin{aligned}
        M &\leftarrow \beta M + G \\
        U &\leftarrow G + \beta M \ \text{(nesterov)} \quad\text{or}\quad M \\
        O &\leftarrow \mathrm{NS}_{k}(U) \approx \text{the polar factor of } U \\
        \eta &\leftarrow \mathrm{lr} \cdot s(\text{full shape})
              \cdot \big(\text{magma}: 0.1 + 0.9\, q\big) \\
        W &\leftarrow (1 - \mathrm{lr}\,\lambda)\, W - \eta\, O
             \quad\text{or, cautious:}\quad W - \mathrm{lr}\,\lambda\,
             [\operatorname{sign} O = \operatorname{sign} W] \odot W - \eta\, O
        \end{aligned}

    where :math:`s` is ``adjust_lr``'s scale of the whole matrix (never a shard's) and
    :math:`q`, Magma's score per matrix, an EMA (``magma_beta``) of
    :math:`(1 + \cos(M, G)) / 2`. Other parameters take torch's AdamW.

    Groups carry ``"algorithm": "muon" | "adamw"``; a group without it is split, >=2-D
    parameters to Muon and the rest to AdamW. Muon parameters may be plain tensors or
    DTensors on any mesh (FSDP2, HSDP, expert or tensor parallel): whole matrices are
    gathered onto one owner rank each, orthogonalized there, and scattered back, so the
    update equals single-device Muon.

    The step never waits for the device. All ranks agree on the device which gradients
    exist and are finite; a parameter without a gradient on any rank is left alone, one
    without a gradient on some ranks takes a zero gradient there (Muon and AdamW alike), and
    a non-finite gradient anywhere leaves every parameter and all state as they were. The
    host learns of it later, where it reads the step's flags: with CUDA tensors at the next
    ``step()``, ``state_dict()`` or :meth:`check_finite`; with CPU tensors at the end of the
    step itself.

    Args:
        params: parameters, ``(name, parameter)`` pairs, or param-group dicts (as
            :func:`muon_dist.param_groups` returns).
        lr (float, default 0.02): Muon's learning rate.
        momentum (float, default 0.95): Muon's momentum coefficient :math:`\beta`.
        nesterov (bool, default True): feed :math:`G + \beta M` to Newton–Schulz, else
            :math:`M`.
        weight_decay (float, default 0.0): Muon's decoupled weight decay :math:`\lambda`.
        adjust_lr (str | None, default "spectral_norm"): lr scale from the full matrix
            shape: ``"spectral_norm"`` :math:`\sqrt{\max(1, rows/cols)}`, ``"rms_norm"``
            :math:`0.2\sqrt{\max(rows, cols)}` (matches AdamW's update RMS), None: 1.
        ns_steps (int, default 5): Newton–Schulz iterations.
        coefficients (str | sequence, default "quintic"): ``"quintic"``, ``"keller"``,
            ``"polar_express"`` or a list of ``(a, b, c)`` per iteration.
        backend (str, default "auto"): Newton–Schulz kernels, ``"torch"``, ``"triton"``
            (CUDA) or ``"auto"`` (Triton where measured faster); also picks the fused form
            of the momentum and update passes.
        ns_method (str, default "auto"): ``"standard"``, ``"gram"`` or ``"auto"`` (see
            :func:`muon_dist.kernels.newton_schulz`).
        comm_dtype (torch.dtype, default torch.bfloat16): dtype of gathers and scatters.
        muon_mode (str, default "2d"): >2-D weights as ``"flat"`` ``[out, prod(rest)]``
            or ``"slice"`` (one matrix per leading index); ``"2d"`` refuses them.
        adamw_lr (float, default 3e-4): lr of AdamW groups.
        adamw_betas (tuple, default (0.9, 0.95)): AdamW's betas.
        adamw_eps (float, default 1e-8): AdamW's eps.
        adamw_weight_decay (float, default 0.0): AdamW's weight decay.
        bucket_bytes (int, default 128 MiB): gathered matrix bytes each owner handles per
            bucket.
        max_inflight (int, default 3): buckets in flight at once.
        replica_mode (str, default "split"): HSDP replicas split the Newton–Schulz work
            (``"split"``) or each redo it (``"redundant"``).
        ns_dtype (torch.dtype, default torch.bfloat16): dtype Newton–Schulz runs in.
        nonfinite (str, default "raise"): on a non-finite gradient, raise
            ``FloatingPointError`` naming the parameters and the step, or ``"skip_step"``:
            count it in ``skipped_steps`` and log a warning (a non-finite Newton–Schulz
            result skips the step too).
        magma (bool, default False): damp each matrix's update by how well its gradient
            agrees with its momentum (Magma-lite).
        magma_beta (float, default 0.9): EMA coefficient of Magma's score.
        cautious_wd (bool, default False): decay only weights whose sign the update shares.
        qk_clip (sequence of QKClip, default ()): MuonClip: rescale attention query and
            key heads whose logits exceed tau after each step (:mod:`muon_dist.qk_clip`).
        max_logits (MaxLogitTracker | None, default None): records the logits ``qk_clip``
            reads.
        cuda_graph (bool, default False): capture the whole step in one CUDA graph after
            ``graph_warmup`` eager steps and replay it (:mod:`muon_dist.cuda_graph`).
        graph_warmup (int, default 2): eager steps before the capture.
        overlap (str, default "none"): ``"backward"`` starts each bucket's Newton–Schulz
            and exchanges from FSDP2's gradient hooks during backward, and ``step()``
            finishes them and commits (:mod:`muon_dist.backward_start`); Muon parameters
            must then be DTensors sharded by ``fully_shard``, and ``cuda_graph`` False.
        process_group (ProcessGroup | None, default None): the ranks holding plain-tensor
            replicas, if not the world; DTensor parameters need none.

    Per group also: ``experts`` (3-D expert stacks), ``num_experts`` (fused experts),
    ``num_heads`` (orthogonalize each head's rows), ``split_sizes``, ``split_groups`` and
    ``transposed`` (fused weights, ``[in, out]`` storage); the README's Options section
    lists them all.
    """

    # Long by design: the signature lists every option (documented in Args above) and the
    # defaults below map each to its group key; the work is in _init_groups and _bind_step.
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
        overlap: str = "none",
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
            overlap=overlap,
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
        self._runner: StepRunner | None = None
        # What torch reads: its schedulers scale "lr" and cycle "momentum" (OneCycleLR,
        # CyclicLR), which is Muon's; AdamW groups keep their betas. Groups get their own
        # algorithm's defaults in add_param_group, never these.
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        groups = _split_by_algorithm(params, self._defaults_by_algorithm)
        self._init_groups(groups, defaults, replica_mode, process_group, qk_clip)
        self._bind_step(cuda_graph, qk_clip, max_logits)
        logger.info("muon_dist.Muon routing:\n%s", self.routing_table())

    # -- construction -------------------------------------------------------------------

    def _init_groups(
        self,
        groups: list[dict[str, Any]],
        defaults: dict[str, Any],
        replica_mode: str,
        process_group: dist.ProcessGroup | None,
        qk_clip: Sequence[QKClip],
    ) -> None:
        """Add the groups and check that every rank built the same ones.

        A group refused on this rank only (options that differ across ranks) is agreed
        through the rank check, so the other ranks raise too instead of waiting."""
        refused: ValueError | TypeError | None = None
        try:
            super().__init__(groups, defaults=defaults)
        except (ValueError, TypeError) as exc:
            refused = exc
        self._comm = comm_groups(
            [p for g in groups for p in g["params"]], replica_mode, process_group
        )
        if self.settings.overlap == "backward":
            # Exchanges issued during backward run beside FSDP's, not behind them.
            self._comm = dataclasses.replace(self._comm, exchange=dedicated(self._comm.exchange))
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

    def _bind_step(
        self, cuda_graph: bool, qk_clip: Sequence[QKClip], max_logits: MaxLogitTracker | None
    ) -> None:
        """Build the step (unsupported layouts fail here, not mid-training) and its hooks."""
        runner = self.runner
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
                lambda opt, _args, _kwargs: clipper(opt.runner.agreement.found_inf)
            )

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
        if algorithm == "muon" and self.settings.overlap == "backward":
            register_grad_hooks(group["params"], names, self._grad_ready)
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
        _ = self.runner

    def routing_table(self) -> str:
        """Which parameter goes where, its matrix view and lr scale, as printable text."""
        return format_routing_table(routing_entries(self.param_groups))

    def _named_params(self) -> dict[str, torch.Tensor]:
        return {name: p for name, _, p in named_params(self.param_groups)}

    def _grad_ready(self, p: torch.Tensor) -> None:
        """A Muon parameter's post-accumulate-grad hook (``overlap="backward"``); a step
        not built yet (groups just changed) starts at ``step()`` instead."""
        if self._runner is not None:
            self._runner.grad_ready(p)

    @property
    def runner(self) -> StepRunner:
        """The step machinery bound to the current groups (:mod:`muon_dist.step_runner`):
        the plan and Muon phase, the agreement, the CUDA graph. Built on first use and again
        after the groups change; for tools and tests that look inside a step."""
        if self._runner is None:
            self._runner = StepRunner(self.param_groups, self.state, self.settings, self._comm)
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
        runner = self.runner
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
            _apply_policy(outcome, self.settings.nonfinite, self.param_groups)


def _apply_policy(outcome: Outcome, nonfinite: str, groups: list[dict[str, Any]]) -> None:
    """Raise for a failed step, or count and log a skipped one (``nonfinite``)."""
    step = outcome.step
    if outcome.crashed_rank is not None:
        kept = (
            "parameters and state were left as they were on every rank"
            if nonfinite == "skip_step"
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
    if nonfinite == "skip_step":
        for group in groups:
            group["skipped_steps"] += 1
        logger.warning(
            "muon_dist.Muon: skipped step %d (%s); %d skipped so far",
            step,
            reason,
            groups[0]["skipped_steps"],
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


def _split_by_algorithm(
    params: Iterable[Any], defaults_by_algorithm: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Normalise the constructor's input to groups that each name their algorithm.

    A group without an algorithm is split; each part keeps the keys the other algorithm's
    part alone reads out of it (a Muon part drops ``betas``, an AdamW part ``momentum``)."""
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
            other = "adamw" if algorithm == "muon" else "muon"
            foreign = set(defaults_by_algorithm[other]) - set(defaults_by_algorithm[algorithm])
            part = {k: v for k, v in group.items() if k not in foreign}
            part.update(algorithm=algorithm, params=[raw[i] for i in chosen])
            if names is not None:
                part["param_names"] = [names[i] for i in chosen]
            groups.append(part)
    return groups
