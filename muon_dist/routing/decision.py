"""A routing decision: the algorithm, the Muon view options and the reason."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from muon_dist.routing.structure import ViewOptions


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


def frozen(options: ViewOptions) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)
