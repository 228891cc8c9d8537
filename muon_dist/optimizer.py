"""The Muon optimizer: Muon for hidden matrices, AdamW for the rest, in one torch Optimizer.

This module is the torch-facing shell: construction, validation, param groups,
``state_dict`` and hooks. What a step computes lives in :mod:`muon_dist.rules.ops`; the
step machinery in :mod:`muon_dist.step.runner` (and the Muon phase it runs,
:mod:`muon_dist.step.program.muon_phase`), the device-side agreement on gradients in
:mod:`muon_dist.step.agree.agreement`, capture in :mod:`muon_dist.step.launch.cuda_graph`,
and the rank and checkpoint checks in :mod:`muon_dist.state.checks`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.comm.consensus import agreed_comm
from muon_dist.comm.groups import CommGroups
from muon_dist.options.schema import OPTIONS, SETTINGS, args_section, group_defaults
from muon_dist.options.settings import ExecutionSettings
from muon_dist.options.validation import check_lr, check_step_values, validate_group
from muon_dist.plan.views import named_params, param_list
from muon_dist.qk_clip import MaxLogitTracker, QKClip, qk_clipper
from muon_dist.routing.param_groups import UnlabelledRouting
from muon_dist.routing.table import format_routing_table, routing_entries
from muon_dist.state.group_state import (
    checked_group,
    checked_load,
    held_before_load,
    init_state,
    restore_after_load,
    saved_copies,
)
from muon_dist.state.rebind import follow_params
from muon_dist.state.tensors import local
from muon_dist.step.agree.report import apply_policy
from muon_dist.step.launch.backward import register_grad_hooks
from muon_dist.step.launch.cuda_graph import CaptureChoice
from muon_dist.step.launch.overlap_choice import OverlapChoice
from muon_dist.step.runner import StepRunner

logger = logging.getLogger(__name__)

# Device types whose autocast the step turns off (those torch knows that can be enabled).
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")


class Muon(torch.optim.Optimizer):
    r"""Distributed Muon with AdamW for non-matrix parameters.

    For each matrix :math:`W` of a Muon group (gradient :math:`G`, momentum :math:`M`),
    one step computes :math:`M \leftarrow \beta M + G`, orthogonalizes :math:`U = G + \beta M`
    (Nesterov) or :math:`M` with Newton–Schulz into :math:`O`, and sets
    :math:`W \leftarrow (1 - \mathrm{lr}\,\lambda) W - \mathrm{lr}\cdot s\cdot O`, with
    :math:`s` the ``adjust_lr`` scale of the whole matrix, never a shard's
    (:func:`muon_dist.rules.muon.reference`, with Magma and cautious decay; NorMuon and
    Dion2 in :mod:`muon_dist.rules`). Other parameters take torch's AdamW.

    Groups carry ``"algorithm": "muon" | "adamw"`` (a group without it is split by
    dimension). Muon parameters may be plain tensors or DTensors on any mesh: whole matrices
    are gathered onto one owner rank each, orthogonalized there and scattered back, so the
    update equals single-device Muon. The step never waits for the device: the ranks agree
    there which gradients exist and are finite, and a non-finite one anywhere leaves every
    parameter and all state as they were; the host learns of it where it reads the step's
    flags (the next ``step()``, ``state_dict()`` or :meth:`check_finite`; on CPU at once).
    The ``Args:`` below are written from :mod:`muon_dist.options.schema`.
    """

    # The signature lists every option (documented in Args above); muon_dist.options.schema
    # declares each once, and a test holds these defaults to it.
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
        rule: str = "muon",
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        dion2_fraction: float = 0.25,
        cautious_wd: bool = False,
        momentum_dtype: str | None = None,
        qk_clip: Sequence[QKClip] = (),
        max_logits: MaxLogitTracker | None = None,
        cuda_graph: bool | str = "auto",
        graph_warmup: int = 2,
        process_group: dist.ProcessGroup | None = None,
        overlap: str = "none",
    ) -> None:
        arguments = dict(locals())
        refused = self._take_settings(arguments)
        self._defaults_by_algorithm: dict[str, dict[str, Any]] = {
            algorithm: group_defaults(algorithm, arguments) for algorithm in OPTIONS
        }
        self._runner: StepRunner | None = None
        self._capture: CaptureChoice | None = None  # set before the step is first built
        self._constructed = False  # add_param_group agrees on each later group by itself
        self._process_group = process_group
        self._qk_lines = [repr(spec) for spec in qk_clip]
        # What torch reads: its schedulers scale "lr" and cycle "momentum" (OneCycleLR,
        # CyclicLR), Muon's; each group gets its own algorithm's defaults, never these.
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self._init_groups(params, defaults, refused)
        self._constructed = True
        self._bind_step(qk_clip, max_logits)
        logger.info("muon_dist.Muon routing:\n%s", self.routing_table())

    # -- construction -------------------------------------------------------------------

    def _take_settings(self, arguments: dict[str, Any]) -> Exception | None:
        """Set the step's settings from the constructor's ``arguments``, or return why they
        are refused. A refusal on this rank only (a setting that differs across ranks) is
        agreed through the rank check in :meth:`_init_groups`, so the other ranks raise too."""
        try:
            self.settings = ExecutionSettings(**{o.key: arguments[o.key] for o in SETTINGS})
        except (ValueError, TypeError) as exc:
            return exc
        return None

    def _init_groups(
        self, params: Iterable[Any], defaults: dict[str, Any], refused: Exception | None
    ) -> None:
        """Add the groups and agree with every rank that holds them on everything that
        decides a step (:mod:`muon_dist.comm.consensus`). Anything refused on this rank only (a
        setting or option that differs across ranks) is agreed through that check, so the
        other ranks raise too instead of waiting."""
        groups: list[dict[str, Any]] = []
        try:
            groups = _split_by_algorithm(params, self._defaults_by_algorithm)
            if refused is None:
                super().__init__(groups, defaults=defaults)
        except (ValueError, TypeError) as exc:
            refused = refused or exc
        # The ranks holding the parameters agree, also where this rank refused them.
        self._comm = self._agree(groups if refused else self.param_groups, refused, "construction")

    def _agree(
        self, groups: Sequence[dict[str, Any]], refused: Exception | None, when: str
    ) -> CommGroups:
        """The collectives' groups for ``groups``, after every rank that holds them agreed on
        them (see :mod:`muon_dist.comm.consensus`); raises on every rank otherwise."""
        settings = getattr(self, "settings", None)  # None: refused at construction
        return agreed_comm(groups, refused, when, settings, self._process_group, self._qk_lines)

    def _bind_step(self, qk_clip: Sequence[QKClip], max_logits: MaxLogitTracker | None) -> None:
        """Build the step (unsupported layouts fail here, not mid-training) and its hooks."""
        device = local(self.param_groups[0]["params"][0]).device
        self._capture = CaptureChoice(self.settings, device, self._comm)
        runner = self.runner
        self._overlap = OverlapChoice(self.settings.overlap, runner.device)
        if self.settings.overlap == "backward" and self._comm.rank == 0:
            logger.warning(
                "muon_dist.Muon: overlap='backward' has not been measured faster than "
                "overlap='none' (benchmarks/README.md, 'Overlap with backward': its hooks' host "
                "time delays backward); overlap='auto' times both modes on this job and keeps "
                "the faster"
            )
        clipper = qk_clipper(
            qk_clip, max_logits, self._named_params(), self._comm.rank, self._comm.holders
        )
        if clipper is not None:
            self.register_step_post_hook(lambda opt, *_: clipper(opt.runner.found_inf))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checked as the constructor checks its groups; after construction,
        agreed across the ranks that hold the parameters before anything changes."""
        if not self._constructed:  # the constructor agrees on all its groups at once
            self._add_group(self._checked_group(param_group))
            return
        group: dict[str, Any] | None = None
        refused: Exception | None = None
        try:
            group = self._checked_group(param_group)
        except (ValueError, TypeError) as exc:
            refused = exc
        self._comm = self._agree(
            [*self.param_groups, group or param_group], refused, "add_param_group"
        )
        assert group is not None  # _agree raised the refusal otherwise
        self.check_finite()  # the last step's outcome, read before its step is replaced
        self._add_group(group)
        _ = self.runner  # built here, as at construction: every step() has one to refuse through

    def _checked_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """``param_group`` checked and completed
        (:func:`muon_dist.state.group_state.checked_group`)."""
        return checked_group(
            param_group, self.param_groups, self._defaults_by_algorithm, self.settings.overlap
        )

    def _add_group(self, group: dict[str, Any]) -> None:
        """Add a checked group and its state: momenta in one flat buffer per group, so the
        step stores them in one pass."""
        algorithm = group["algorithm"]
        # torch fills missing keys from ``defaults``, which are Muon's; this group already
        # holds its own algorithm's keys, and must not gain the other's.
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults
        self._runner = None
        if algorithm == "muon" and self.settings.starts_in_backward:
            register_grad_hooks(group["params"], self._grad_ready)
        init_state(group, len(self.param_groups) - 1, self.state)

    def state_dict(self) -> dict[str, Any]:
        """The state, after reading the last step's outcome (see :meth:`check_finite`).

        Momenta are copies: the optimizer keeps them as views of one flat buffer per group,
        which torch cannot pickle as DTensors, so ``torch.save(opt.state_dict())`` works.
        Refused, as :meth:`step` refuses it, while a group holds an edit the state cannot
        follow: the checkpoint would pair that edit with a state built without it."""
        self.check_finite()
        try:
            self._refuse_group_edits(self._runner)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"state_dict() refused: {exc}") from exc
        return saved_copies(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by Muon, matching parameters by name. Everything is checked
        before anything is replaced (routing, group keys and options as the constructor
        checks them, every state entry and tensor) and agreed across the ranks: on any
        error, on any rank, the optimizer is as it was on every rank."""
        self.check_finite()  # the last step's outcome, before its step is rebuilt below
        loaded: dict[str, Any] | None = None
        refused: Exception | None = None
        try:
            loaded = checked_load(state_dict, self.param_groups, self._defaults_by_algorithm)
        except (ValueError, TypeError, KeyError) as exc:
            refused = exc
        self._agree(
            self.param_groups
            if loaded is None
            else [
                {**g, **saved, "params": g["params"]}
                for g, saved in zip(self.param_groups, loaded["param_groups"], strict=True)
            ],
            refused,
            "load_state_dict",
        )
        assert loaded is not None  # _agree raised the refusal otherwise
        before = (self.state, self.param_groups, self._runner)
        try:
            self._load(loaded)
        except BaseException:
            self.state, self.param_groups, self._runner = before
            raise

    def _load(self, loaded: dict[str, Any]) -> None:
        """Replace the state and groups with checked ``loaded`` ones (see load_state_dict)."""
        own, fp32 = held_before_load(self.state, loaded, self.param_groups)
        super().load_state_dict(loaded)
        restore_after_load(self.state, own, fp32, self.param_groups)
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
        """A Muon parameter's post-accumulate-grad hook (``overlap="backward"`` or
        ``"auto"``): it starts buckets only in a step that overlaps backward; a step not
        built yet (groups just changed) starts at ``step()`` instead."""
        if self._runner is not None and self._overlap.overlapping:
            self._runner.grad_ready(p)

    @property
    def overlap_mode(self) -> str:
        """The mode steps run in: ``"none"`` or ``"backward"``, the ``overlap`` setting's or
        the one ``overlap="auto"`` chose, or ``"measuring"`` while ``"auto"`` times its
        trial steps (:mod:`muon_dist.step.launch.auto_overlap`)."""
        return self._overlap.mode

    @property
    def overlap_choice(self) -> OverlapChoice:
        """Each step's overlap mode and, under ``overlap="auto"``, its timing: the agreed
        ``medians`` once chosen, and the ``clock`` (replaceable before the trials, for
        tests and tools). Kept when the step is rebuilt."""
        return self._overlap

    @property
    def runner(self) -> StepRunner:
        """The step machinery bound to the current groups (:mod:`muon_dist.step.runner`):
        the plan and Muon phase, the agreement, the CUDA graph. Built on first use and again
        after the groups change; for tools and tests that look inside a step."""
        if self._runner is None:
            capture = self._capture
            settings = self.settings if capture is None else capture.settings
            self._runner = StepRunner(self.param_groups, self.state, settings, self._comm)
            if capture is not None:
                capture.bind(self._runner.graph)
        return self._runner

    @property
    def uncaptured_reason(self) -> str | None:
        """Why steps run eagerly under ``cuda_graph="auto"`` (None: they are captured, or
        ``cuda_graph`` is True or False); :mod:`muon_dist.step.launch.cuda_graph`."""
        return None if self._capture is None else self._capture.uncaptured_reason

    # -- step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step for every group: every rank reaches the same outcome (the same exception,
        or the same update), and a step that fails changes nothing. The ranks agree on the
        device, in one all-reduce, on gradients, options and refusals; a refusing rank
        raises its error, the others ``RuntimeError`` naming it, a bad gradient
        ``FloatingPointError`` (or is skipped) where the host reads the outcome. A refused
        step is not counted in ``steps``. README, "Reliability", says what is agreed.
        Under ``overlap="auto"`` every call, raised or not, is one step of its schedule."""
        try:
            return self._step(closure)
        finally:
            self._overlap.step_ended(self._comm)

    def _step(self, closure: Any) -> Any:
        """The body of :meth:`step`."""
        loss = None
        refusal: Exception | None = None
        if closure is not None:
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as exc:  # agreed in the step, so no other rank waits for it
                refusal = exc
        self.check_finite()
        try:
            self._follow_groups()
        except (TypeError, ValueError) as exc:
            refusal = refusal or exc
        runner = self.runner
        with _autocast_off():
            failure = runner.run(self.param_groups, refusal, overlap=self._overlap.overlapping)
        on_host = runner.queued(self.param_groups[0]["steps"] + 1, failure)
        if failure is None or (failure is runner.crash() and self.settings.nonfinite == "raise"):
            for group in self.param_groups:  # a refused step changed nothing: not counted
                group["steps"] += 1
        if failure is not None:
            raise failure
        if on_host:
            self.check_finite()
        return loss

    def _follow_groups(self) -> None:
        """Refuse group edits the state cannot follow, check the keys and step values, and
        rebuild the step where it no longer fits the groups and parameters
        (:mod:`muon_dist.step.changes`, :meth:`muon_dist.step.runner.StepRunner.stale`),
        state moved along with storage. Groups that hold what the last step checked, the lr
        and step counts aside (``runner.checked``), have only their lr checked."""
        previous = self.runner
        groups = self.param_groups
        if previous.checked.unchanged(groups):
            check_lr(groups)  # schedulers set it at every step; the rest is as last checked
            reason = previous.moved()
        else:
            self._refuse_group_edits(previous)
            reason = previous.stale(groups)
            if reason is None:
                previous.checked.record(groups)
        if reason is None:
            return
        for index, group in enumerate(groups):
            validate_group(group, index)
        logger.info("muon_dist.Muon: %s; rebuilding the step", reason)
        follow_params(groups, self.state)
        self._runner = None
        try:
            rebuilt = self.runner
        except (TypeError, ValueError):
            self._runner = previous  # this step is refused through the step it replaces
            raise
        rebuilt.replacing(previous)
        rebuilt.checked.record(groups)

    def _refuse_group_edits(self, runner: StepRunner | None) -> None:
        """Raise, by name, for a group edit the state built by ``runner`` cannot follow, a
        key no option declares, an option removed or a bad value of one."""
        refused = None if runner is None else runner.built.refused(self.param_groups)
        if refused is not None:
            raise ValueError(refused)
        check_step_values(self.param_groups)

    def check_finite(self) -> None:
        """Read the last step's outcome (on CUDA, waiting for that step only) and apply the
        ``nonfinite`` policy; ``step()`` and ``state_dict()`` call it first."""
        if self._runner is None:
            return
        outcome = self._runner.outcome()
        if outcome is not None:
            apply_policy(outcome, self.settings.nonfinite, self.param_groups)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "muon_dist.Muon cannot be pickled or deep-copied: it is bound to its parameters, "
            "process groups and device buffers. Build a Muon on the copied model and "
            "new_opt.load_state_dict(opt.state_dict()) (torch.save and DCP work on that)"
        )


Muon.__doc__ = f"{Muon.__doc__}\n" + textwrap.indent(
    args_section([name for name in inspect.signature(Muon.__init__).parameters][1:]), "    "
)


def _split_by_algorithm(
    params: Iterable[Any], defaults_by_algorithm: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Normalise the constructor's input to groups that each name their algorithm.

    A group without an algorithm is split as
    :class:`muon_dist.routing.param_groups.UnlabelledRouting` routes it (by name where its
    parameters are named); each part keeps the keys the other algorithm's part alone reads
    out of it (a Muon part drops ``betas``, an AdamW part ``momentum``)."""
    items = param_list(params)
    if not items:
        raise ValueError("Muon got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups: list[dict[str, Any]] = []
    unlabelled = UnlabelledRouting()
    for group in items:
        group = dict(group)
        raw = param_list(group["params"])
        if raw and isinstance(raw[0], tuple):
            group["param_names"] = [name for name, _ in raw]
            raw = [p for _, p in raw]
        group["params"] = raw
        if "algorithm" in group:
            groups.append(group)
            continue
        names = group.get("param_names")
        mode = group.get("muon_mode", defaults_by_algorithm["muon"]["muon_mode"])
        routes = unlabelled.routes(raw, names, mode)
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
    unlabelled.warn()
    return groups


def _autocast_off() -> contextlib.ExitStack[bool | None]:
    """Autocast disabled for every device type where it is on: the step's dtypes are its
    settings' (``ns_dtype``, ``comm_dtype``), never an enclosing autocast region's."""
    stack = contextlib.ExitStack()
    if not torch._C._is_any_autocast_enabled():  # one call where no autocast is on
        return stack
    for device_type in _AUTOCAST_DEVICES:
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
