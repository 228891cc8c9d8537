"""One decision per parameter: which algorithm updates it, how Muon views it, and why.

:func:`muon_dist.param_groups` builds a :class:`Router` over a model and asks it about
every parameter; the decisions are pure (types, shapes, names and the config, never values).
Order: the caller's ``overrides`` and ``fused``; then what is not a hidden matrix (biases,
vectors, state-space parameters, embeddings and heads by the model's API
(:mod:`muon_dist.routing.heads`), tables, convolutions); then the matrix view. Parts,
orientation, expert stacks and tables come only from evidence: the owning module's class
(``nn.Linear``, ``Conv1D``, ``nn.MultiheadAttention``, the family table of
:mod:`muon_dist.routing.known_modules`, layouts a module declares) or the caller. Config
sums and names never split: they only propose, in the audit and as warnings, the keyword
that would.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from muon_dist.routing import evidence, guesses
from muon_dist.routing.decision import Route, frozen, shape_text
from muon_dist.routing.known_modules import known_block, module_layout, plain_linear
from muon_dist.routing.layouts import Layout, titan_layout
from muon_dist.routing.observation import Observation
from muon_dist.routing.structure import (
    STATE_SPACE_NAMES,
    ConfigDims,
    Stacks,
    ViewOptions,
    common_input_width,
    hf_config,
    is_conv,
    is_transposed_linear,
    linear_shape,
    matrix_sides,
)

CONV_CHOICES = ("adamw", "muon")


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
        observed: Mapping[str, Observation],
        unobserved: tuple[str, bool] | None,  # (why, inputs may help)
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
        self.num_experts = num_experts
        self.conv = conv
        self.min_side = min_matrix_side
        self.known_layouts = known_layouts
        self.muon_mode = muon_mode
        self.embedding_ids = embedding_ids
        self.head_ids = head_ids
        self.observed = observed
        # Why the forward said nothing of a parameter, and whether other inputs may reach
        # it; None: observation is off.
        self.unobserved = unobserved
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
        module_name, leaf = _owner_path(name)
        owner = self.modules.get(module_name)
        shape = tuple(int(s) for s in p.shape)
        if forced == "adamw":
            return Route("adamw", "override", decay=p.ndim >= 2)
        if forced is None:
            role = self._non_matrix(name, leaf, owner, p, shape)
            if role is not None:
                return role
        if forced in ("muon:flat", "muon:slice"):
            mode = forced.partition(":")[2]
            return Route("muon", f"override, muon_mode={mode!r}", frozen({"muon_mode": mode}))
        if forced == "muon" and owner is not None and is_conv(owner):
            return Route(
                "muon",
                "override; convolution flattened [out, in*k]",
                frozen({"muon_mode": "flat"}),
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
        if owner is not None and is_conv(owner):
            return self._conv(owner, shape)
        if sum(s > 1 for s in shape) < 2 and self._raw(owner):  # [1, 1, H]: a gain
            return Route("adamw", f"vector stored {shape_text(shape)}", decay=False)
        seen = self.observed.get(name)
        observed = evidence.non_matrix(seen)
        if observed is not None:
            return observed
        layout = self._layout(name, owner, shape)
        if layout is not None and layout.table and evidence.settled(seen) is None:
            return Route("adamw", layout.reason)
        if self._expert(name) and p.ndim == 2 and owner is not None:
            stacks = [s for s in owner.parameters(recurse=False) if s.ndim == 3]
            if any(s.shape[0] == shape[0] for s in stacks):
                return Route("adamw", "per-expert vector beside an expert stack", decay=False)
        if p.ndim > 2 and not self._stacked(name, shape, layout):
            if shape[0] == 1:  # a leading broadcast dimension: added to activations
                return Route("adamw", f"broadcast tensor {shape_text(shape)}, not a linear map")
            if self.muon_mode != "2d":
                return None
            return evidence.tensor_route(name, shape, seen)
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
        return Route("muon", reason, frozen({"muon_mode": "flat"}))

    def _small(self, matrix: tuple[int, int]) -> str:
        return f"small matrix {shape_text(matrix)} (side < min_matrix_side={self.min_side})"

    def _muon_view(
        self,
        name: str,
        owner: nn.Module | None,
        p: torch.Tensor,
        shape: tuple[int, ...],
        declared: ViewOptions | None,
    ) -> Route:
        """The Muon route of a matrix, stack or (with conv='muon') convolution: parts,
        orientation and experts from evidence only, by kind: what the module classes say,
        then what the forward shows (it wins), then the caller's ``fused=``; a guess
        proposes the rest."""
        layout = self._layout(name, owner, shape)
        view = self._class_view(name, owner, p, shape, layout)
        seen = self.observed.get(name) if p.ndim == 2 else None
        _observed_view(view, name, shape, layout, seen)
        if declared is not None:  # the caller's layout replaces parts and expert counts
            kept = {k: v for k, v in view.options.items() if k in ("experts", "transposed")}
            route = Route("muon", "fused= declared", frozen({**kept, **declared}))
            return self._checked(name, shape, route)
        self._unsettled(view, name, owner, shape, layout, seen)
        route = Route("muon", "; ".join(view.reasons), frozen(view.options), guess=view.guess)
        return self._checked(name, shape, route)

    def _class_view(
        self,
        name: str,
        owner: nn.Module | None,
        p: torch.Tensor,
        shape: tuple[int, ...],
        layout: Layout | None,
    ) -> _View:
        """What the module classes say: the owner's type (orientation; expert weights and
        stacks by the modules named in ``expert_keys``), then the family table's layout."""
        view = _View()
        if p.ndim == 2:
            _, _, transposed = linear_shape(owner, shape)
            kind = type(owner).__name__ if owner is not None else "parameter"
            view.reasons.append(f"{kind} {'[in, out]' if transposed else '[out, in]'}")
            if transposed:
                view.options["transposed"] = True
            if layout is None and self._raw(owner) and self._expert(name):
                fused = (
                    ({}, "one numbered expert")
                    if self._one_expert(name)
                    else guesses.fused_experts(name, shape, self.num_experts, self.dims.experts)
                )
                if isinstance(fused, str):
                    view.guess = fused
                else:
                    view.options.update(fused[0])
                    view.reasons.append(fused[1])
        elif p.ndim == 3 and self._stacked(name, shape, layout):
            view.options["experts"] = True
            if layout is None:
                view.reasons.append("expert stack (module named experts), read [E, out, in]")
                stacks = self._stacks_of(name.rpartition(".")[0], owner)
                view.guess = guesses.stack_guess(stacks, name, owner, shape)
        elif p.ndim > 2:
            view.reasons.append(f"{p.ndim}-D tensor, muon_mode={self.muon_mode!r}")
        if layout is not None and not layout.table:
            view.options.update(layout.options)
            view.reasons.append(layout.reason)
            if p.ndim == 2 and view.options.get("transposed"):  # the class, not the type
                view.reasons[0] = view.reasons[0].replace("[out, in]", "[in, out]")
        return view

    def _unsettled(
        self,
        view: _View,
        name: str,
        owner: nn.Module | None,
        shape: tuple[int, ...],
        layout: Layout | None,
        seen: Observation | None,
    ) -> None:
        """Where neither a class nor the forward settles a matrix: the warning for a cut
        no option says, the audit's proposal from config sums and names (a warning where
        the name suggests fusion), or the warning that it was not observed (none for a
        plain linear layer inside a block of the family table, which says each of its
        other linear layers is one map)."""
        if seen is not None and seen.kind == "untraceable" and layout is None:
            view.guess = evidence.untraceable(name, shape, seen)
            return
        settled = layout is not None or evidence.settled(seen) is not None
        if settled or len(shape) != 2 or "num_experts" in view.options:
            return
        transposed = bool(view.options.get("transposed"))
        proposal = guesses.proposal(self.dims, name, shape, transposed)
        if proposal is not None:
            view.reasons.append(proposal[0])
            view.guess = view.guess or proposal[1]
        if view.guess is not None or seen is not None or self.unobserved is None:
            return
        if plain_linear(owner) and known_block(self.modules, name) is not None:
            return
        bare = self._raw(owner) and name.rpartition(".")[2] != "weight"
        view.guess = evidence.unobserved(name, shape, transposed, *self.unobserved, bare)

    def _layout(self, name: str, owner: nn.Module | None, shape: tuple[int, ...]) -> Layout | None:
        """What the module classes on the parameter's path say about it (the family
        table, declared expert layouts, torchtitan's modules), where ``known_layouts``."""
        if isinstance(owner, nn.MultiheadAttention) and name.endswith("in_proj_weight"):
            if shape[0] == 3 * shape[1]:
                return Layout(
                    {"split_sizes": [shape[1]] * 3}, "nn.MultiheadAttention: q, k, v blocks"
                )
        if not self.known_layouts:
            return None
        found = module_layout(self.modules, name, shape)
        if found is None and self.config is None:
            parts = name.split(".")
            grandparent = self.modules.get(".".join(parts[:-2])) if len(parts) > 2 else None
            rows = shape[1] if len(shape) == 3 else shape[0]
            found = titan_layout(owner, grandparent, name, rows)
        return found

    def _checked(self, name: str, shape: tuple[int, ...], route: Route) -> Route:
        """AdamW instead for a matrix (per expert for stacks) with a side below
        ``min_matrix_side``; other >2-D tensors are on Muon by the caller's ``muon_mode``."""
        if len(shape) > 2 and not dict(route.options).get("experts"):
            return route
        matrix = (shape[-2], shape[-1])
        if min(matrix) < self.min_side:
            return Route("adamw", self._small(matrix))
        return route

    # -- experts --------------------------------------------------------------------------

    def _expert(self, name: str) -> bool:
        """Whether a module on the parameter's path is named one of ``expert_keys`` (a whole
        name part: ``shared_experts`` is not ``experts``)."""
        return any(part in self.expert_keys for part in name.split(".")[:-1])

    @staticmethod
    def _raw(owner: nn.Module | None) -> bool:
        """A parameter of its own, not the weight of a linear layer (which is one matrix,
        whatever module holds it: Switch's ``experts.expert_0.wi``, JetMoE's router)."""
        return not isinstance(owner, nn.Linear) and not is_transposed_linear(owner)

    def _one_expert(self, name: str) -> bool:
        """Whether the parameter belongs to one numbered expert module (``experts.3.w1``)."""
        parts = name.split(".")[:-1]
        return any(a in self.expert_keys and b.isdigit() for a, b in itertools.pairwise(parts))

    def _stacked(self, name: str, shape: tuple[int, ...], layout: Layout | None) -> bool:
        """A 3-D stack of experts: by its module's class, or under a module named one of
        ``expert_keys``."""
        if len(shape) != 3:
            return False
        return self._expert(name) or (layout is not None and bool(layout.options.get("experts")))

    def _stacks_of(self, module_name: str, owner: nn.Module | None) -> Stacks:
        if module_name not in self._stacks:
            params = list(owner.named_parameters(recurse=False)) if owner is not None else []
            params = [(n, p) for n, p in params if "bias" not in re.split(r"[_\W]+", n)]
            self._stacks[module_name] = Stacks.of(params, self.dims.hidden)
        return self._stacks[module_name]


@dataclass
class _View:
    """A Muon route being made: its view options, the audit's reasons, and a guess."""

    options: ViewOptions = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    guess: str | None = None


def _observed_view(
    view: _View,
    name: str,
    shape: tuple[int, ...],
    layout: Layout | None,
    seen: Observation | None,
) -> None:
    """What the forward shows of a 2-D matrix, where it settles the view: it wins over
    the classes' parts and orientation, and where the family table read it otherwise the
    guess says both."""
    if evidence.settled(seen) is None or seen is None:
        return
    if layout is not None:
        view.guess = evidence.disagreement(name, shape, layout, seen)
    kept = {k: v for k, v in view.options.items() if k not in evidence.OBSERVED_KEYS}
    if {**kept, **seen.options} != view.options:  # the audit says what the forward added
        view.options = {**kept, **seen.options}
        view.reasons = [view.reasons[0].split(" [")[0], seen.reason, *view.reasons[1:]]


def _owner_path(name: str) -> tuple[str, str]:
    """``(module, leaf)`` of a parameter; a parametrized one (weight norm's
    ``conv.parametrizations.weight.original0``) belongs to the module it parametrizes."""
    base, found, rest = name.partition(".parametrizations.")
    if found:
        return base, rest.split(".")[0]
    module, _, leaf = name.rpartition(".")
    return module, leaf
