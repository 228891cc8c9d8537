"""What changed in the groups since a step was built, and what that change calls for.

A step binds its plan, views and state to the groups as they were when it was built
(:class:`muon_dist.step.runner.StepRunner`). Between steps the user or a scheduler may edit
``opt.param_groups``; each kind of edit gets one answer:

- a ``per_step`` option (lr, momentum, ...): read by every step, nothing to do here;
- any other option read when the step is built (``ns_steps``, ``coefficients``,
  ``adjust_lr``, ``dion2_fraction``, ...): the step is rebuilt at the next ``step()``, as
  torch's optimizers, which bind nothing, simply follow;
- an option that decides the matrix views or the state's layout (``rule``, ``muon_mode``,
  ``magma``, ``momentum_dtype``, ...), a group's ``algorithm``, its parameter list or
  names, or the number of groups: refused, naming the change and the way to make it (the
  state would not fit).

Ranks must agree on a rebuilt plan before its collectives run; the caller checks that
(:meth:`muon_dist.step.runner.StepRunner.run`, ``previous``).

Most steps change nothing but the lr and the step counts: :class:`GroupWatch` tells such a
step by object identity, and the step then skips every check that reads the groups again.

A refused step still runs its collectives, so the other ranks learn of the refusal; it runs
them on the option values the step was built from (:meth:`BuiltFrom.restored`), never on
the values it refused: a NaN read into a masked update is NaN however it is masked.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.options.schema import LAYOUT_STATE, OPTIONS, layout_keys, plan_keys

# Values a group entry holds that cannot change in place: one of the same type and
# ``repr`` as the last checked value is as good as the same object.
_ATOMS = (bool, int, float, str, type(None), torch.dtype)
# Entries compared item by item: the parameters by identity, their names by value.
_LISTS = ("params", "param_names")


@dataclass(frozen=True)
class _Group:
    """One group as a step was built from it: the ``repr`` of its options (a list edited in
    place must still count as changed) and its parameters by identity."""

    algorithm: str
    params: tuple[int, ...]
    names: tuple[str, ...] | None
    layout: dict[str, str]
    plan: dict[str, str]

    @classmethod
    def of(cls, group: dict[str, Any]) -> _Group:
        algorithm = group["algorithm"]
        names = group.get("param_names")
        return cls(
            algorithm,
            tuple(id(p) for p in group["params"]),
            None if names is None else tuple(names),
            {k: repr(group[k]) for k in layout_keys(algorithm)},
            {k: repr(group[k]) for k in plan_keys(algorithm)},
        )


class BuiltFrom:
    """The groups a step was built from, compared with the groups of a later step."""

    def __init__(self, groups: Sequence[dict[str, Any]]) -> None:
        self._groups = [_Group.of(g) for g in groups]
        # Each group dict with copies of its option values (checked before the build).
        self._values = [
            (g, {o.key: copy.deepcopy(g[o.key]) for o in OPTIONS[g["algorithm"]]}) for g in groups
        ]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The groups' options set to the values the step was built from, and back to the
        user's (the same objects, a removed key removed again) on leaving."""
        edited = [{k: group[k] for k in values if k in group} for group, values in self._values]
        try:
            for group, values in self._values:
                group.update(copy.deepcopy(values))
            yield
        finally:
            for (group, values), own in zip(self._values, edited, strict=True):
                for key in values:
                    if key in own:
                        group[key] = own[key]
                    else:
                        del group[key]

    def refused(self, groups: Sequence[dict[str, Any]]) -> str | None:
        """Why ``groups`` cannot be stepped with this state, or None."""
        if len(groups) != len(self._groups):
            return (
                f"opt.param_groups has {len(groups)} groups, and the optimizer was built with "
                f"{len(self._groups)}: add groups with opt.add_param_group(...), which checks "
                "them and creates their state"
            )
        for index, (built, group) in enumerate(zip(self._groups, groups, strict=True)):
            problem = _refused_change(index, built, group)
            if problem is not None:
                return problem
        return None

    def replanned(self, groups: Sequence[dict[str, Any]]) -> str | None:
        """The first option read when the step is built whose value changed, as text, or
        None (call after :meth:`refused` found nothing)."""
        for index, (built, group) in enumerate(zip(self._groups, groups, strict=True)):
            for key, before in built.plan.items():
                now = repr(group[key])
                if now != before:
                    return f"param group {index} {key} changed from {before} to {now}"
        return None


def _refused_change(index: int, built: _Group, group: dict[str, Any]) -> str | None:
    where = f"param group {index}"
    if group.get("algorithm") != built.algorithm:
        return (
            f"{where} algorithm changed from {built.algorithm!r} to {group.get('algorithm')!r} "
            "since the optimizer was built; the state is the algorithm's: set it back, or "
            "build a new muon_dist.Muon with the groups you want (its state starts fresh: "
            "load_state_dict refuses a state whose parameters changed algorithm)"
        )
    params = group["params"]
    if tuple(map(id, params)) != built.params:
        ids, held = {id(p) for p in params}, set(built.params)
        added = len(ids - held)
        removed = len(held - ids)
        return (
            f"{where} 'params' changed since the optimizer was built ({added} added, "
            f"{removed} removed, or reordered); the step and the state are bound to them: "
            "set the list back, then add parameters with opt.add_param_group(...), or "
            "build a new muon_dist.Muon over the parameters you want"
        )
    names = group.get("param_names")
    if (None if names is None else tuple(names)) != built.names:
        return (
            f"{where} 'param_names' changed since the optimizer was built; the state is saved "
            "and loaded by these names: set them back"
        )
    for key, before in built.layout.items():
        value = repr(group[key])
        if value != before:
            return (
                f"{where} {key} changed from {before} to {value} since the optimizer was built; "
                f"{key} decides the matrix views or the state's layout: set it back, then "
                + (
                    f"build a new muon_dist.Muon with {key}={value} and load this one's state "
                    "into it (new.load_state_dict(opt.state_dict())): the momenta carry over, "
                    + LAYOUT_STATE[key]
                    if key in LAYOUT_STATE
                    else f"build a new muon_dist.Muon with {key}={value}, whose state starts "
                    "fresh (a state saved under other matrix views is refused)"
                )
            )
    return None


class _Checked:
    """One group as the last step that checked it left it: its keys, the values compared
    (by position in the group), the ``repr`` of those that may change in place, and its
    parameters and their names."""

    def __init__(self, group: dict[str, Any], skipped: frozenset[str]) -> None:
        self.group = group
        self.keys = list(group)
        positions = [i for i, k in enumerate(self.keys) if k not in skipped and k not in _LISTS]
        if len(positions) == 1:  # itemgetter returns a tuple from two positions up
            positions *= 2
        self.compared = [self.keys[i] for i in positions]
        # The compared values, read in one C call.
        pick = operator.itemgetter(*positions) if positions else None
        self._pick: Callable[[list[Any]], tuple[Any, ...]] = pick or (lambda _: ())
        self.values = self._pick(list(group.values()))
        self.texts = {
            k: repr(v)
            for k, v in zip(self.compared, self.values, strict=True)
            if not isinstance(v, _ATOMS)
        }
        self.params = tuple(group["params"])
        names = group.get("param_names")
        self.names = None if names is None else tuple(names)

    def holds(self, group: dict[str, Any]) -> bool:
        if group is not self.group or list(group) != self.keys:
            return False
        now = self._pick(list(group.values()))
        if not all(map(operator.is_, now, self.values)):
            for key, value, seen in zip(self.compared, now, self.values, strict=True):
                if value is seen or key in self.texts:
                    continue  # the values kept as text are compared below
                same = isinstance(value, _ATOMS) and type(value) is type(seen)
                if not (same and repr(value) == repr(seen)):  # repr: -0.0 is not 0.0
                    return False
        params = group["params"]
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return False
        names = group.get("param_names")
        if (None if names is None else tuple(names)) != self.names:
            return False
        return all(repr(group[k]) == text for k, text in self.texts.items())


class GroupWatch:
    """Whether the groups still hold what the last checked step saw: a step whose groups do
    needs none of the checks that read them (:meth:`BuiltFrom.refused`,
    :meth:`BuiltFrom.replanned`, the step values' checks) again.

    The ``skipped`` entries (the lr, which schedulers set at every step and the step checks
    anyway, and the step counts) are not compared. A value counts as unchanged when it is
    the same object, or a number, string or dtype of the same type and ``repr``; any other
    value (a list, which may be edited in place) when its ``repr`` is; the parameters and their
    names when the lists hold the same objects in the same order. ``edits`` counts the
    :meth:`record` calls: it moves whenever a changed group was checked again.
    """

    def __init__(self, skipped: frozenset[str]) -> None:
        self._skipped = skipped
        self._checked: list[_Checked] | None = None
        self.edits = 0

    def record(self, groups: Sequence[dict[str, Any]]) -> None:
        """``groups`` passed every check."""
        self._checked = [_Checked(g, self._skipped) for g in groups]
        self.edits += 1

    def unchanged(self, groups: Sequence[dict[str, Any]]) -> bool:
        """Whether ``groups`` hold what :meth:`record` last saw, the ``skipped`` entries
        aside."""
        checked = self._checked
        if checked is None or len(groups) != len(checked):
            return False
        return all(c.holds(g) for c, g in zip(checked, groups, strict=True))
