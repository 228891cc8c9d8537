"""One decision per parameter: which algorithm updates it, how Muon views it, and why.

:func:`muon_dist.param_groups` builds a :class:`Router` over a model and asks it about
every parameter; the decisions are pure (types, shapes, names and the config, never values).
Order: the caller's ``overrides`` and ``fused``; then structure (:mod:`muon_dist.routing.structure`:
embeddings, heads, vectors, state-space parameters, convolutions, expert containers and
orientation); for fused parts, the family table (:mod:`muon_dist.routing.families`: interleavings
and splits the config cannot tell) before the config's contiguous sums; names last, and
only as warnings.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from muon_dist.plan.views import normalize_fqn
from muon_dist.routing.families import family_rule, suggests_fusion, titan_rule
from muon_dist.routing.structure import (
    STATE_SPACE_NAMES,
    ConfigDims,
    Stacks,
    ViewOptions,
    common_input_width,
    hf_config,
    is_conv,
    linear_shape,
    matrix_sides,
)

CONV_CHOICES = ("adamw", "muon")


@dataclass(frozen=True)
class Route:
    """The decision for one parameter. ``options`` are Muon group options of its view;
    AdamW parameters with ``decay=False`` (vectors, biases, state-space parameters) never
    take weight decay. ``guess`` says what was guessed and which option settles it."""

    algorithm: str
    reason: str
    options: tuple[tuple[str, Any], ...] = ()
    decay: bool = True
    guess: str | None = None

    def group_key(self) -> tuple[Any, ...]:
        if self.algorithm == "muon":
            return ("muon", self.options)
        return ("adamw_decay",) if self.decay else ("adamw_no_decay",)


def _frozen(options: ViewOptions) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


class Router:
    """Routing decisions for the parameters of one model.

    ``modules`` maps normalised module names to modules; ``adamw_modules`` holds the ids of
    embedding and head parameters (by module type and name pattern)."""

    def __init__(
        self,
        model: nn.Module,
        modules: Mapping[str, nn.Module],
        *,
        expert_keys: Sequence[str],
        num_experts: int | None,
        conv: str,
        min_matrix_side: int,
        known_layouts: bool,
        muon_mode: str,
        embedding_ids: set[int],
        head_ids: set[int],
    ) -> None:
        if conv not in CONV_CHOICES:
            raise ValueError(
                f"conv={conv!r}; choose 'adamw' (convolutions to AdamW, the default) or "
                "'muon' (each filter bank flattened to [out, in*k])"
            )
        if not isinstance(min_matrix_side, int) or min_matrix_side < 1:
            raise ValueError(
                f"min_matrix_side={min_matrix_side!r}; pass a positive int (matrices with a "
                "shorter side go to AdamW; 1 keeps every matrix on Muon)"
            )
        self.config = hf_config(model)
        self.dims = ConfigDims.of(self.config)
        if not self.dims.hidden:  # no config: the width of the embeddings, else of the matrices
            widths = {m.embedding_dim for m in modules.values() if isinstance(m, nn.Embedding)}
            if not widths:
                common = common_input_width(p.shape for p in model.parameters())
                widths = {common} if common is not None else set()
            self.dims = ConfigDims(hidden=frozenset(widths))
        self.modules = modules
        self.expert_keys = tuple(expert_keys)
        self.num_experts = num_experts if num_experts is not None else self.dims.experts
        self.conv = conv
        self.min_side = min_matrix_side
        self.known_layouts = known_layouts
        self.muon_mode = muon_mode
        self.embedding_ids = embedding_ids
        self.head_ids = head_ids
        self._stacks: dict[str, Stacks] = {}

    # -- the decision ---------------------------------------------------------------------

    def route(
        self,
        name: str,
        p: torch.Tensor,
        forced: str | None,
        declared: ViewOptions | None,
    ) -> Route:
        """The route of parameter ``name`` (normalised); ``forced`` is the caller's override
        and ``declared`` its ``fused=`` options, both already matched to this name."""
        module_name, _, leaf = name.rpartition(".")
        owner = self.modules.get(module_name)
        shape = tuple(int(s) for s in p.shape)
        if forced == "adamw":
            return Route("adamw", "override", decay=p.ndim >= 2)
        if forced is None:
            role = self._non_matrix(name, leaf, owner, p, shape)
            if role is not None:
                return role
        if forced == "muon" and owner is not None and is_conv(owner):
            return Route(
                "muon",
                "override; convolution flattened [out, in*k]",
                _frozen({"muon_mode": "flat"}),
            )
        route = self._muon_view(name, owner, p, shape, declared)
        if forced == "muon":
            return Route("muon", f"override; {route.reason}", route.options)
        return route

    def _non_matrix(
        self,
        name: str,
        leaf: str,
        owner: nn.Module | None,
        p: torch.Tensor,
        shape: tuple[int, ...],
    ) -> Route | None:
        """The AdamW route of a parameter that is not a hidden matrix, or None."""
        if "bias" in re.split(r"[_\W]+", leaf):
            return Route("adamw", "bias", decay=False)
        if leaf in STATE_SPACE_NAMES and not isinstance(owner, nn.Linear):
            return Route("adamw", f"state-space parameter ({leaf})", decay=False)
        if p.ndim < 2:
            return Route("adamw", "vector (norm, scale or gain)", decay=False)
        if id(p) in self.embedding_ids:
            return Route("adamw", "embedding")
        if id(p) in self.head_ids:
            return Route("adamw", "output head")
        if self._expert(name) and p.ndim == 2 and owner is not None:
            stacks = [s for s in owner.parameters(recurse=False) if s.ndim == 3]
            if any(s.shape[0] == shape[0] for s in stacks):
                return Route("adamw", "per-expert vector beside an expert stack", decay=False)
        if owner is not None and is_conv(owner):
            return self._conv(owner, shape)
        if p.ndim > 2 and not self._stacked(name, shape):
            if self.muon_mode != "2d":
                return None
            guess = (
                f"{_regex(name)} ({_shape_text(shape)}) is neither a convolution nor an expert "
                f"stack: it goes to AdamW; to orthogonalize it pass overrides={{{_regex(name)!r}"
                ": 'muon'} with muon_mode='flat' or 'slice'"
            )
            return Route("adamw", f"unknown {p.ndim}-D tensor", guess=guess)
        return None

    def _conv(self, owner: nn.Module, shape: tuple[int, ...]) -> Route:
        kind = type(owner).__name__
        if self.conv == "adamw":
            return Route("adamw", f"{kind} (conv='adamw')")
        if isinstance(owner, nn.modules.conv._ConvTransposeNd):
            return Route("adamw", f"{kind}: stored [in, out/groups, *k], not flattened")
        groups = getattr(owner, "groups", 1)
        if groups != 1:  # depthwise or grouped: one small map per group, not one matrix
            return Route("adamw", f"{kind} with groups={groups}: not one linear map")
        flat = matrix_sides(shape, "flat", stacked=False)
        if min(flat) < self.min_side:
            return Route("adamw", self._small(flat))
        reason = f"{kind} (conv='muon'), flattened [out, in*k]"
        return Route("muon", reason, _frozen({"muon_mode": "flat"}))

    def _small(self, matrix: tuple[int, int]) -> str:
        return f"small matrix {_shape_text(matrix)} (side < min_matrix_side={self.min_side})"

    def _muon_view(
        self,
        name: str,
        owner: nn.Module | None,
        p: torch.Tensor,
        shape: tuple[int, ...],
        declared: ViewOptions | None,
    ) -> Route:
        """The Muon route of a matrix, stack or (with conv='muon') convolution."""
        options: ViewOptions = {}
        reasons: list[str] = []
        guess = None
        out_dim, in_dim = shape[0], shape[-1]
        if p.ndim == 2:
            out_dim, in_dim, transposed = linear_shape(owner, shape)
            kind = type(owner).__name__ if owner is not None else "parameter"
            reasons.append(f"{kind} {'[in, out]' if transposed else '[out, in]'}")
            if transposed:
                options["transposed"] = True
            if self._expert(name) and not self._one_expert(name):
                fused = self._fused_experts(name, shape)
                if isinstance(fused, str):
                    guess = fused
                else:
                    options.update(fused[0])
                    reasons.append(fused[1])
                    out_dim //= fused[0]["num_experts"]
        elif p.ndim == 3 and self._stacked(name, shape):
            out_dim, in_dim, guess = self._stack_view(name, owner, shape, options, reasons)
        elif p.ndim > 2:
            reasons.append(f"{p.ndim}-D tensor, muon_mode={self.muon_mode!r}")
        if declared is not None:
            options.update(declared)
            return self._checked(name, shape, Route("muon", "fused= declared", _frozen(options)))
        split = self._split(name, owner, out_dim, in_dim)
        if split is not None:
            options.update(split[0])
            reasons = [r for r in reasons if not r.startswith("gate and up")] + [split[1]]
        elif guess is None and "split_sizes" not in options and suggests_fusion(name):
            guess = (
                f"{_regex(name)} ({_shape_text(shape)}) is named like fused matrices but "
                "neither the config nor the family table splits it: orthogonalized whole; pass "
                "fused="
                f"{{{_regex(name)!r}: {{'split_sizes': [...]}}}} (plus 'split_groups' for "
                "interleaved parts), or {'split_sizes': [rows]} to keep it whole and silence this"
            )
        return self._checked(
            name, shape, Route("muon", "; ".join(reasons), _frozen(options), guess=guess)
        )

    def _stack_view(
        self,
        name: str,
        owner: nn.Module | None,
        shape: tuple[int, ...],
        options: ViewOptions,
        reasons: list[str],
    ) -> tuple[int, int, str | None]:
        """An expert stack's orientation and fused halves (into ``options`` and ``reasons``):
        its ``(out, in)`` and the guess to warn of, if any."""
        options["experts"] = True
        stacks = self._stacks_of(name.rpartition(".")[0], owner)
        reasons.append(self._stack_reason(name))
        if stacks.in_out:
            options["transposed"] = True
            out_dim, in_dim = shape[2], shape[1]
        else:
            out_dim, in_dim = shape[1], shape[2]
        guess = None
        if stacks.in_out is None and len(stacks.fused) == 0 and self._siblings(owner) > 1:
            guess = (
                f"{_regex(name)} ({_shape_text(shape)}): its container's shapes do not tell "
                f"[E, out, in] from [E, in, out]; read as [E, out, in]; pass fused="
                f"{{{_regex(name)!r}: {{'transposed': True}}}} if it is applied as x @ W[e]"
            )
        if name.rpartition(".")[2] in stacks.fused:
            options["split_sizes"] = [out_dim // 2, out_dim // 2]
            reasons.append("gate and up halves (twice the down projection's width)")
        return out_dim, in_dim, guess

    def _checked(self, name: str, shape: tuple[int, ...], route: Route) -> Route:
        """AdamW instead for a matrix (per expert for stacks) with a side below
        ``min_matrix_side``; other >2-D tensors are on Muon by the caller's ``muon_mode``."""
        if len(shape) > 2 and not self._stacked(name, shape):
            return route
        matrix = (shape[-2], shape[-1])
        if min(matrix) < self.min_side:
            return Route("adamw", self._small(matrix))
        return route

    def _split(
        self, name: str, owner: nn.Module | None, out_dim: int, in_dim: int
    ) -> tuple[ViewOptions, str] | None:
        """Fused parts from torch's attention module, the family table, or the config."""
        if isinstance(owner, nn.MultiheadAttention) and name.rpartition(".")[2] == "in_proj_weight":
            if out_dim == 3 * in_dim:
                return {"split_sizes": [in_dim] * 3}, "nn.MultiheadAttention: q, k, v blocks"
        if self.known_layouts:
            if self.config is not None:
                rule = family_rule(self.config, name, out_dim, in_dim)
            else:
                parts = name.split(".")
                grandparent = self.modules.get(".".join(parts[:-2])) if len(parts) > 2 else None
                rule = titan_rule(owner, grandparent, name, out_dim)
            if rule is not None:
                return rule
        found = self.dims.fused_split(name, out_dim, in_dim)
        if found is None:
            return None
        return {"split_sizes": found[0]}, found[1]

    # -- experts --------------------------------------------------------------------------

    def _expert(self, name: str) -> bool:
        """Whether a module on the parameter's path is named one of ``expert_keys`` (a whole
        name part: ``shared_experts`` is not ``experts``)."""
        return any(part in self.expert_keys for part in name.split(".")[:-1])

    def _one_expert(self, name: str) -> bool:
        """Whether the parameter belongs to one numbered expert module (``experts.3.w1``)."""
        parts = name.split(".")[:-1]
        return any(a in self.expert_keys and b.isdigit() for a, b in itertools.pairwise(parts))

    def _stacked(self, name: str, shape: tuple[int, ...]) -> bool:
        """A 3-D stack of experts: under an expert module, or as many along dim 0 as the
        config has experts."""
        if len(shape) != 3:
            return False
        return self._expert(name) or (
            self.dims.experts is not None and shape[0] == self.dims.experts
        )

    def _stack_reason(self, name: str) -> str:
        if self._expert(name):
            return "expert stack (module named experts)"
        return f"expert stack (config: {self.dims.experts} experts along dim 0)"

    def _fused_experts(self, name: str, shape: tuple[int, ...]) -> tuple[ViewOptions, str] | str:
        """2-D expert weights ``[E*m, n]``: E from ``num_experts`` or the config; a guess
        (the text to show) where E is not known."""
        experts = self.num_experts
        if experts is None or shape[0] % experts:
            return (
                f"{_regex(name)} ({_shape_text(shape)}) is a 2-D weight under an expert module, "
                "orthogonalized as one matrix; pass num_experts=E if it stacks E experts "
                "[E*m, n]"
            )
        source = "num_experts" if self.num_experts != self.dims.experts else "config"
        return {"num_experts": experts}, f"{experts} fused experts [E*m, n] ({source})"

    def _stacks_of(self, module_name: str, owner: nn.Module | None) -> Stacks:
        if module_name not in self._stacks:
            params = list(owner.named_parameters(recurse=False)) if owner is not None else []
            params = [(n, p) for n, p in params if "bias" not in re.split(r"[_\W]+", n)]
            self._stacks[module_name] = Stacks.of(params, self.dims.hidden)
        return self._stacks[module_name]

    @staticmethod
    def _siblings(owner: nn.Module | None) -> int:
        if owner is None:
            return 0
        return sum(1 for p in owner.parameters(recurse=False) if p.ndim == 3)


def _regex(name: str) -> str:
    """A regex matching ``name`` at the end of a parameter name, layer numbers generalised."""
    return re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


def embedding_and_head_ids(
    model: nn.Module, head_patterns: Sequence[str], embedding_patterns: Sequence[str]
) -> tuple[set[int], set[int]]:
    """Ids of parameters owned by embedding tables, and by output heads."""
    embeddings: set[int] = set()
    heads: set[int] = set()
    for mod_name, module in model.named_modules():
        name = normalize_fqn(mod_name)
        own = {id(p) for p in module.parameters(recurse=False)}
        if isinstance(module, nn.Embedding) or _matches(name, embedding_patterns):
            embeddings |= own
        elif isinstance(module, nn.Linear) and _matches(name, head_patterns):
            heads |= own
    return embeddings, heads
