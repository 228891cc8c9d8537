"""Every routing argument of :func:`muon_dist.param_groups`, declared once: its default and
what it means.

:func:`muon_dist.routing.param_groups.route_model` fills what it is not given from these
declarations, :func:`muon_dist.param_groups` hands them on by this list, the Trainer
integration tells routing arguments from the optimizer's by it, and the tests hold
``param_groups``' signature and the README's ``param_groups`` table to it (as
:mod:`muon_dist.options.schema` declares the optimizer's options).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from muon_dist.routing.heads import HEAD_NAMES

EXPERT_KEYS = ("experts", "routed_experts")
EMBEDDING_PATTERNS = (r"(^|\.)(embed\w*|wte|wpe|tok_embeddings)$",)
HEAD_PATTERNS = HEAD_NAMES
MIN_MATRIX_SIDE = 4


@dataclass(frozen=True)
class Argument:
    """One routing argument: its keyword, its default and what it means."""

    key: str
    default: Any
    meaning: str


ROUTING_ARGUMENTS: tuple[Argument, ...] = (
    Argument(
        "expert_keys",
        EXPERT_KEYS,
        "a parameter is an expert weight when a module on its path is named exactly one of these",
    ),
    Argument("num_experts", None, "how many experts a raw 2-D expert weight [E*m, n] stacks"),
    Argument("head_patterns", None, "name patterns of output heads, besides the model's API"),
    Argument(
        "embedding_patterns",
        EMBEDDING_PATTERNS,
        "names of modules whose own parameters are embeddings",
    ),
    Argument("overrides", None, "{name regex: algorithm} or (name, param) -> algorithm"),
    Argument("fused", None, "{name regex: view options} replacing the routing's parts"),
    Argument("known_layouts", True, "apply the family table and the layouts modules declare"),
    Argument("conv", "adamw", "convolutions to AdamW, or 'muon' flattened [out, in*k]"),
    Argument("min_matrix_side", MIN_MATRIX_SIDE, "a matrix with a shorter side goes to AdamW"),
    Argument("example_inputs", None, "inputs for the observed forward; None: the model's own"),
    Argument("observe", True, "run the forward once and route by what it shows"),
)

ARGUMENT_KEYS = tuple(a.key for a in ROUTING_ARGUMENTS)


def routing_arguments(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every routing argument: ``given``'s, else its declared default; an unknown keyword
    raises, naming the known ones."""
    unknown = sorted(set(given) - set(ARGUMENT_KEYS))
    if unknown:
        raise TypeError(f"unknown routing arguments {unknown}; choose among {list(ARGUMENT_KEYS)}")
    return {a.key: given.get(a.key, a.default) for a in ROUTING_ARGUMENTS}
