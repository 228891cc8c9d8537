"""What an update rule of Muon groups declares, so that the step, the state and the checks
ask the rule instead of comparing its name.

A rule file (:mod:`muon_dist.rules.muon`, :mod:`muon_dist.rules.normuon`,
:mod:`muon_dist.rules.dion2`) opens with its plain-torch single-matrix reference, then
defines a :class:`Rule` subclass; :mod:`muon_dist.rules.registry` is the only place a rule
is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class MatrixStep:
    """The scalars of one matrix's step, as a rule's plain reference takes them: the
    learning rate, the decoupled weight decay, the momentum coefficient β, whether
    Newton–Schulz reads Nesterov's ``G + β·M``, and the lr scale of the full matrix shape
    (:func:`muon_dist.rules.scale.lr_scale`)."""

    lr: float
    weight_decay: float
    beta: float
    nesterov: bool
    scale: float


@dataclass(frozen=True)
class RulePart:
    """What a rule adds to a stack's recipe, so that one stack holds matrices its owner
    treats alike: the rule, and what of the view or the group its own parts read."""

    name: str
    transposed: bool | None = None  # the storage order, where the rule reads output rows
    fraction: float | None = None  # Dion2's share of slices


class ViewShape(Protocol):
    """What a rule reads of a matrix view: how many matrices, and their ``(out, in)``."""

    @property
    def count(self) -> int: ...

    @property
    def out_in(self) -> tuple[int, int]: ...


class Rule:
    """An update rule: Muon's step with its own pre- and post-orthogonalization parts.

    The base class is Muon's behaviour; a rule overrides what it changes.
    """

    name: ClassVar[str]
    # The rule's wing: what it adds to the step (its owner part, write part, exchange, hooks,
    # state tensors), as "module:Class". The step imports it by this name
    # (:mod:`muon_dist.step.wings.registry`): a rule sits below the step and does not import it.
    wing: ClassVar[str] = "muon_dist.step.wings.muon:MuonWing"
    # Per-parameter state besides the momentum, kept in fp32 whatever the parameter's dtype.
    fp32_state: ClassVar[tuple[str, ...]] = ()

    def state_shapes(self, views: Sequence[ViewShape]) -> dict[str, tuple[int, ...]]:
        """The shapes of this rule's own state (:attr:`fp32_state`) for a parameter viewed
        as ``views``."""
        return {}

    def momentum_carry(self, group: dict[str, Any]) -> float:
        """The factor on the stored momentum when a gradient is added: ``momentum`` (β)."""
        return float(group["momentum"])

    def stack_part(self, group: dict[str, Any], transposed: bool) -> RulePart:
        """This rule's part of the recipe of a stack of ``group``'s matrices stored
        ``transposed`` (``[in, out]``) or not."""
        return RulePart(self.name)

    def travelling_share(self, group: dict[str, Any]) -> float:
        """The share of a matrix that travels to its owner where only a selection does."""
        return 1.0

    def check_group(self, group: dict[str, Any], where: str) -> None:
        """Refuse group options this rule cannot honour (raises ``ValueError``)."""
