"""``param_groups``: a model's parameters as Muon and AdamW groups, with the routing audit.

Each parameter's route comes from :class:`muon_dist.routing.router.Router`; this module applies the
caller's ``overrides`` and ``fused`` patterns, gathers parameters with equal routes into
groups, and shows the audit (every parameter, its view, lr scale and reason) and the
guesses (with the option that settles each) before the first step.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muon_dist.plan.views import ALGORITHMS
from muon_dist.routing.arguments import (
    ARGUMENT_KEYS,
    EMBEDDING_PATTERNS,
    EXPERT_KEYS,
    HEAD_PATTERNS,
    MIN_MATRIX_SIDE,
    routing_arguments,
)
from muon_dist.routing.decision import Route
from muon_dist.routing.forward import Observations
from muon_dist.routing.forward import observe as observe_forward
from muon_dist.routing.heads import embedding_and_head_ids
from muon_dist.routing.names import merged_regex, name_regex, normalize_fqn
from muon_dist.routing.router import Router
from muon_dist.routing.structure import STATE_SPACE_NAMES
from muon_dist.routing.table import format_routing_table, routing_entries

logger = logging.getLogger(__name__)

Override = Callable[[str, torch.Tensor], str | None] | Mapping[str, str]
"""Routing overrides: ``(name, param) -> choice | None``, or name regex -> choice."""

OVERRIDE_CHOICES = (*ALGORITHMS, "muon:flat", "muon:slice")
"""``"muon:flat"`` / ``"muon:slice"``: Muon with this parameter's own ``muon_mode``."""

FUSED_KEYS = ("split_sizes", "num_heads", "split_groups", "transposed", "num_experts")


class _Overrides:
    """Both override forms as one callable; a mapping's first matching pattern wins, and
    :meth:`unmatched` lists the patterns that matched no parameter."""

    def __init__(self, overrides: Override | None) -> None:
        self.fn = overrides if callable(overrides) else None
        self.patterns = dict(overrides) if isinstance(overrides, Mapping) else {}
        for pattern, algorithm in self.patterns.items():
            if algorithm not in OVERRIDE_CHOICES:
                raise ValueError(
                    f"overrides[{pattern!r}]={algorithm!r}; choose one of {list(OVERRIDE_CHOICES)}"
                )
        self.hits: set[str] = set()

    def __call__(self, name: str, p: torch.Tensor) -> str | None:
        if self.fn is not None:
            forced = self.fn(name, p)
        else:
            forced = None
            for pattern, algorithm in self.patterns.items():
                if re.search(pattern, name):
                    self.hits.add(pattern)
                    forced = algorithm
                    break
        if forced not in (*OVERRIDE_CHOICES, None):
            raise ValueError(
                f"overrides returned {forced!r} for {name}; return one of "
                f"{list(OVERRIDE_CHOICES)} or None (default routing)"
            )
        if forced is not None and forced.startswith("muon") and p.ndim < 2:
            raise ValueError(
                f"overrides routed {name} (shape {tuple(p.shape)}) to 'muon', but Muon needs "
                ">= 2-D parameters"
            )
        return forced

    def unmatched(self) -> list[str]:
        return [p for p in self.patterns if p not in self.hits]


class _Declared:
    """The caller's ``fused`` patterns, checked, and which of them matched."""

    def __init__(self, fused: Mapping[str, Mapping[str, Any]] | None) -> None:
        self.patterns = dict(fused or {})
        for pattern, spec in self.patterns.items():
            unknown = sorted(set(spec) - set(FUSED_KEYS))
            if unknown or not spec:
                raise ValueError(
                    f"fused[{pattern!r}] has keys {sorted(spec)}; use some of {list(FUSED_KEYS)}"
                )
        self.hits: set[str] = set()

    def __call__(self, name: str) -> dict[str, Any] | None:
        hits = [pattern for pattern in self.patterns if re.search(pattern, name)]
        if len(hits) > 1:
            raise ValueError(f"{name} matches several fused patterns {hits}; make them exclusive")
        if not hits:
            return None
        self.hits.add(hits[0])
        return dict(self.patterns[hits[0]])


def param_groups(
    model: nn.Module,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    *,
    adamw_betas: tuple[float, float] | None = None,
    adamw_eps: float | None = None,
    expert_keys: Sequence[str] = EXPERT_KEYS,
    num_experts: int | None = None,
    head_patterns: Sequence[str] | None = None,
    embedding_patterns: Sequence[str] = EMBEDDING_PATTERNS,
    overrides: Override | None = None,
    fused: Mapping[str, Mapping[str, Any]] | None = None,
    known_layouts: bool = True,
    conv: str = "adamw",
    min_matrix_side: int = MIN_MATRIX_SIDE,
    example_inputs: Any = None,
    observe: bool = True,
    report: bool = False,
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split a model's parameters into Muon and AdamW groups for :class:`muon_dist.Muon`.

    Hidden matrices go to Muon, each seen as its module applies it: parts, orientation,
    expert stacks and tables only on evidence (the model's forward, run once on the meta
    device on ``example_inputs`` or the model's own dummy inputs where ``observe``; the
    owning module's class, the family table of :mod:`muon_dist.routing.known_modules`,
    layouts a module declares); embeddings
    and heads by the model's API and structure; biases, vectors, state-space parameters,
    tables, convolutions (``conv="muon"`` flattens them), small matrices and other >2-D
    tensors go to AdamW. A config sum or a name never splits: it only proposes, in the
    audit and (for fusion-like names) as a warning, the ``fused=`` that would. ``fused``
    (layouts by name regex, replacing the routing's parts and expert count) and
    ``overrides`` (algorithm by name regex or callable) win; a pattern that matches nothing
    raises. Groups hold only the options passed here. The audit (every parameter, its
    view, lr scale and reason) is logged at INFO and printed by rank 0 with
    ``report=True``. The README's ``param_groups`` reference has every argument.
    """
    given = locals()
    routing = {key: given[key] for key in ARGUMENT_KEYS}  # muon_dist.routing.arguments
    routes = route_model(model, muon_mode=muon_options.get("muon_mode", "2d"), **routing)
    buckets: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[str]]] = {}
    for name, (p, route) in routes.items():
        params, names = buckets.setdefault(route.group_key(), ([], []))
        params.append(p)
        names.append(name)
    groups = _groups(buckets, lr, adamw_lr, weight_decay, adamw_betas, adamw_eps, muon_options)
    _audit(routes, groups, report)
    return groups


def _audit(
    routes: dict[str, tuple[torch.Tensor, Route]], groups: list[dict[str, Any]], report: bool
) -> None:
    """Warn of every guess with the option that settles it; log the audit (and print it on
    rank 0 with ``report``)."""
    reasons = {name: route.reason for name, (_, route) in routes.items()}
    audit = format_routing_table(routing_entries(groups, reasons))
    lines = guess_lines({name: route for name, (_, route) in routes.items()})
    if lines:
        logger.warning(
            "muon_dist.param_groups guessed %d routing(s) of %d parameter(s) (parameter "
            "name regex, shape; one line per pattern, with the parameters it covers); check "
            "them, and pass the option given to settle each:\n- %s",
            len(lines),
            sum(count for _, count in lines),
            "\n- ".join(f"{line} [{count} parameter{'s' * (count != 1)}]" for line, count in lines),
        )
    logger.info("muon_dist routing:\n%s", audit)
    if report and (not dist.is_initialized() or dist.get_rank() == 0):
        print(audit)


def guess_lines(routes: Mapping[str, Route]) -> list[tuple[str, int]]:
    """The warning's lines and how many parameters each covers: guesses that say the same
    of parameters (the same advice, shape and reason, their name regexes aside) are one
    line, whose regex (in the text and in the keyword to paste) matches all of them."""
    grouped: dict[str, list[str]] = {}
    for name, route in routes.items():
        if route.guess is None:
            continue
        regex = name_regex(name)
        template = route.guess.replace(repr(regex), "\0R").replace(regex, "\0P")
        grouped.setdefault(template, []).append(regex)
    lines = []
    for template, regexes in grouped.items():
        merged = merged_regex(regexes)
        lines.append((template.replace("\0R", repr(merged)).replace("\0P", merged), len(regexes)))
    return lines


def route_model(
    model: nn.Module, *, muon_mode: str = "2d", **routing: Any
) -> dict[str, tuple[torch.Tensor, Route]]:
    """Every trainable parameter of ``model`` by normalised name (a tied one under its first
    name), with its route; ``routing`` holds :func:`param_groups`' routing arguments
    (:mod:`muon_dist.routing.arguments`: those not given take their defaults)."""
    args = routing_arguments(routing)
    overrides, fused = args["overrides"], args["fused"]
    route_of = _Overrides(overrides)
    declared = _Declared(fused)
    modules = {normalize_fqn(n): m for n, m in model.named_modules()}
    embeddings, heads = embedding_and_head_ids(
        model, args["head_patterns"], args["embedding_patterns"]
    )
    observed = (
        observe_forward(model, args["example_inputs"])
        if args["observe"]
        else Observations(error="observe=False", ran=False)
    )
    why = observed.error or "its forward on the inputs given did not reach it"
    router = Router(
        model,
        modules,
        expert_keys=args["expert_keys"],
        num_experts=args["num_experts"],
        conv=args["conv"],
        min_matrix_side=args["min_matrix_side"],
        known_layouts=args["known_layouts"],
        muon_mode=muon_mode,
        embedding_ids=embeddings,
        head_ids=heads,
        observed=observed.by_name,
        # Inputs may reach what the forward did not, unless the forward itself failed.
        unobserved=(why, observed.error is None or not observed.ran) if args["observe"] else None,
    )
    routes: dict[str, tuple[torch.Tensor, Route]] = {}
    seen: set[int] = set()
    for raw_name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        name = normalize_fqn(raw_name)
        forced = route_of(name, p)
        routes[name] = (p, router.route(name, p, forced, declared(name) if p.ndim >= 2 else None))
    _check_matched(route_of, declared, {name: route for name, (_, route) in routes.items()})
    _log_unobserved(routes, observed)
    return routes


def _log_unobserved(
    routes: Mapping[str, tuple[torch.Tensor, Route]], observed: Observations
) -> None:
    """Say which Muon matrices the forward did not reach, and why (routed by classes)."""
    missed = [
        n for n, (p, r) in routes.items() if r.algorithm == "muon" and n not in observed.by_name
    ]
    if not missed:
        return
    why = observed.error or "the forward did not reach them"
    patterns = list(dict.fromkeys(name_regex(n) for n in missed))
    logger.info(
        "muon_dist.param_groups: %d Muon parameter(s) not observed (%s); routed by module "
        "class and structure: %s",
        len(missed),
        why,
        ", ".join(patterns),
    )


def _groups(
    buckets: Mapping[tuple[Any, ...], tuple[list[torch.Tensor], list[str]]],
    lr: float | None,
    adamw_lr: float | None,
    weight_decay: float | None,
    adamw_betas: tuple[float, float] | None,
    adamw_eps: float | None,
    muon_options: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """Torch param groups from the buckets of equal routes, Muon's first."""
    given = {"lr": lr, "weight_decay": weight_decay, **muon_options}
    muon = {"algorithm": "muon", **{k: v for k, v in given.items() if v is not None}}
    adamw_given = {"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps}
    adamw = {"algorithm": "adamw", **{k: v for k, v in adamw_given.items() if v is not None}}
    groups = []
    for key, (params, names) in buckets.items():
        group: dict[str, Any] = {"params": params, "param_names": names}
        if key[0] == "muon":
            group.update(muon)
            group.update({k: list(v) if isinstance(v, tuple) else v for k, v in key[1]})
        else:
            group.update(adamw)
            if key[0] == "adamw_no_decay":
                group["weight_decay"] = 0.0
            elif weight_decay is not None:
                group["weight_decay"] = weight_decay
        groups.append(group)
    groups.sort(key=lambda g: g["algorithm"] != "muon")
    return groups


def _check_matched(route_of: _Overrides, declared: _Declared, routes: Mapping[str, Route]) -> None:
    """Every name pattern the caller gave must have matched a parameter."""
    unmatched = [p for p in declared.patterns if p not in declared.hits]
    if unmatched:
        muon_names = [n for n, r in routes.items() if r.algorithm == "muon"]
        raise ValueError(
            f"fused patterns {unmatched} match no Muon matrix; Muon matrices are {muon_names}"
        )
    if route_of.unmatched():
        raise ValueError(
            f"overrides patterns {route_of.unmatched()} match no parameter (patterns are "
            f"searched in normalised names such as {list(routes)[:4]}); fix or remove them"
        )


def algorithm_by_name(name: str, p: torch.Tensor, muon_mode: str) -> tuple[str, bool]:
    """``(algorithm, expert stack)`` of a parameter known only by its name and shape, for
    groups given to :class:`muon_dist.Muon` without ``"algorithm"``: the rules of
    :func:`param_groups` that names and shapes alone can apply (embedding and head module
    names, biases, vectors, state-space names, small 2-D matrices, 3-D stacks under an
    expert module; other >2-D tensors to AdamW unless ``muon_mode`` is "flat" or "slice",
    which the caller chose for them)."""
    name = normalize_fqn(name)
    module, _, leaf = name.rpartition(".")
    if p.ndim < 2 or "bias" in re.split(r"[_\W]+", leaf) or leaf in STATE_SPACE_NAMES:
        return "adamw", False
    if any(re.search(pattern, module) for pattern in (*EMBEDDING_PATTERNS, *HEAD_PATTERNS)):
        return "adamw", False
    stacked = p.ndim == 3 and any(part in EXPERT_KEYS for part in module.split("."))
    if p.ndim > 2 and not stacked and muon_mode == "2d":
        return "adamw", False
    if p.ndim == 2 and min(p.shape) < MIN_MATRIX_SIDE:
        return "adamw", False
    return "muon", stacked


class UnlabelledRouting:
    """Routes for the groups :class:`muon_dist.Muon` gets without ``"algorithm"``, and the
    one warning about them: by name where the parameters are named
    (:func:`algorithm_by_name`), else >= 2-D to Muon and the rest to AdamW."""

    def __init__(self) -> None:
        self.unnamed = False  # some >= 2-D parameter was routed by its dims alone
        self.tensors: list[str] = []  # named >2-D parameters sent to AdamW

    def routes(
        self, params: Sequence[torch.Tensor], names: Sequence[str] | None, muon_mode: str
    ) -> list[tuple[str, bool]]:
        """``(algorithm, expert stack)`` per parameter of one group."""
        if names is None:
            self.unnamed = self.unnamed or any(p.ndim >= 2 for p in params)
            return [("muon" if p.ndim >= 2 else "adamw", False) for p in params]
        routes = [algorithm_by_name(n, p, muon_mode) for n, p in zip(names, params, strict=True)]
        self.tensors += [
            n
            for n, p, (algorithm, _) in zip(names, params, routes, strict=True)
            if p.ndim > 2 and algorithm == "adamw"
        ]
        return routes

    def warn(self) -> None:
        if self.tensors:
            logger.warning(
                "muon_dist.Muon routed %s (>2-D, neither convolutions nor expert stacks by "
                "name alone) to AdamW; pass muon_mode='flat' or 'slice' to orthogonalize them, "
                "or build groups with muon_dist.param_groups(model), which reads their modules",
                ", ".join(self.tensors),
            )
        if self.unnamed:
            logger.warning(
                "muon_dist.Muon got parameters without names or 'algorithm' (as transformers' "
                "Trainer passes them with optimizer_cls_and_kwargs=(Muon, ...)): every >= 2-D "
                "parameter goes to Muon, embeddings and output heads included. Pass "
                "muon_dist.param_groups(model), or model.named_parameters() to route by name; "
                "with the Trainer, optimizer_cls_and_kwargs=(muon_dist.integrations."
                "hf_trainer.MuonFactory, {...})"
            )
