"""Checks of param groups and their parameters, run before anything changes.

The constructor (through ``add_param_group``) and ``load_state_dict`` run the same checks,
so a saved ``lr=nan`` or ``momentum=1.5`` is refused as a constructed one is. Each error
names the group, the key (or parameter), the value and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from muon_dist.kernels.coefficients import resolve_coefficients
from muon_dist.options.schema import OPTIONS, SETTINGS, check_options, number
from muon_dist.plan.views import group_param_names, matrix_views
from muon_dist.rules.registry import RULES

# Each algorithm's check of its lr (:func:`check_lr`).
_LR = {
    algorithm: next(o.check for o in options if o.key == "lr" and o.check is not None)
    for algorithm, options in OPTIONS.items()
}

# Keys a group may hold besides its algorithm's options: bookkeeping of this optimizer and
# the keys torch's lr schedulers add (an unknown key is a misspelling, never ignored).
BOOKKEEPING_KEYS = frozenset(
    {
        "params",
        "param_names",
        "steps",
        "skipped_steps",
        "initial_lr",
        "max_lr",
        "min_lr",
        "base_lr",
        "max_momentum",
        "base_momentum",
    }
)


def check_group_keys(
    group: dict[str, Any], own: Iterable[str], other: Iterable[str], where: str
) -> None:
    """Refuse a key this group's algorithm does not read: another algorithm's option set to
    a value (``num_heads`` on an AdamW group), a setting of the whole optimizer
    (``overlap``), or a misspelling (``weight_decy``, with the closest key suggested).
    ``own`` and ``other`` are the keys of each algorithm."""
    allowed = set(own) | BOOKKEEPING_KEYS
    foreign = set(other) - allowed
    settings = {o.key for o in SETTINGS}
    algorithm = group.get("algorithm", "muon")
    for key, value in group.items():
        if key in allowed:
            continue
        if key in settings:
            raise ValueError(
                f"{where}: {key}={value!r} is a setting of the whole optimizer, not of a "
                f"group, fixed when it is built; remove the key and build a new "
                f"muon_dist.Muon(..., {key}={value!r}), then new.load_state_dict("
                "opt.state_dict()) to carry the state over"
            )
        if key in foreign:
            if value in (None, False):
                continue
            owner = "adamw" if algorithm == "muon" else "muon"
            raise ValueError(
                f"{where}: {key}={value!r} is a {'Muon' if owner == 'muon' else 'AdamW'} "
                f"option; set it on a group with algorithm={owner!r} (valid keys here: "
                f"{', '.join(sorted(set(own) - {'algorithm'}))})"
            )
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(allowed)}"
        raise ValueError(f"{where}: unknown group key {key!r}; {hint}")


def validate_group(group: dict[str, Any], index: int) -> None:
    """Check every option of a full group (its algorithm's defaults filled in)."""
    where = f"param group {index} ({group['algorithm']})"
    check_options(group, where, per_step=True)
    if group["algorithm"] == "muon":
        _validate_muon(group, where)
    _validate_params(group, index, where)


def _validate_muon(group: dict[str, Any], where: str) -> None:
    """The options read when the step is built, and those that go together: the
    Newton–Schulz schedule, and the rule's own refusals."""
    check_options(group, where, per_step=False)
    try:
        schedule = resolve_coefficients(group["coefficients"], group["ns_steps"])
        for k, triple in enumerate(schedule.steps):
            for value in triple:
                number(where, f"coefficients[{k}]", value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    RULES[group["rule"]].check_group(group, where)


def _validate_params(group: dict[str, Any], index: int, where: str) -> None:
    """Each parameter once, real floating point, no empty dim on a matrix."""
    seen: dict[int, str] = {}
    names = group_param_names(group, index)
    for name, p in zip(names, group["params"], strict=True):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: parameter {name!r} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(
                f"{where}: parameter {name!r} is listed twice (also as {seen[id(p)]!r}); "
                "list each parameter once, or it would be updated twice per step"
            )
        seen[id(p)] = name
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(
                f"{where}: parameter {name!r} has dtype {p.dtype}; Muon and AdamW here update "
                "real floating-point tensors (view a complex one with torch.view_as_real)"
            )
        if p.is_sparse:
            raise TypeError(f"{where}: parameter {name!r} is sparse; pass a dense tensor")
        if group["algorithm"] != "muon":
            continue
        if 0 in p.shape:
            raise ValueError(
                f"{where}: parameter {name!r} has shape {tuple(p.shape)} with an empty dim; "
                "Muon orthogonalizes matrices with rows and columns: route it to AdamW "
                "(algorithm='adamw') or drop it"
            )
        matrix_views(p.shape, group, name=f"{where}: parameter {name!r}")


def check_unique_names(groups: Sequence[dict[str, Any]], group: dict[str, Any]) -> None:
    """Refuse a name ``group`` shares with another parameter of this optimizer: state is
    saved and loaded by name, so two parameters under one name would take each other's."""
    index = len(groups)
    seen = {name: i for i, g in enumerate(groups) for name in group_param_names(g, i)}
    for name in group_param_names(group, index):
        if name in seen:
            where = "the same group" if seen[name] == index else f"param group {seen[name]}"
            raise ValueError(
                f"param group {index} ({group['algorithm']}): parameter name {name!r} is "
                f"used twice (also in {where}); state is saved and loaded by name, so two "
                "parameters with one name would take each other's momentum and moments. "
                "Make the names unique, e.g. prefix each model's names: "
                "[(f'tower_a.{n}', p) for n, p in tower_a.named_parameters()]"
            )
        seen[name] = index


def check_lr(groups: Sequence[dict[str, Any]]) -> None:
    """Each group's lr, which schedulers set at every step: what a step checks of groups
    that hold what the last step checked otherwise
    (:class:`muon_dist.step.changes.GroupWatch`)."""
    for index, group in enumerate(groups):
        algorithm = group["algorithm"]
        _LR[algorithm](f"param group {index} ({algorithm})", "lr", group["lr"])


def check_step_values(groups: Sequence[dict[str, Any]]) -> None:
    """The keys and the options a scheduler or the user may change between steps, checked
    at each step (a few comparisons per group): a key added that no option declares (the
    other algorithm's options excepted), a setting, an option removed, ``momentum=1.0`` or
    a NaN lr is refused by name before anything changes, instead of being ignored or
    surfacing as an overflow or a non-finite result."""
    keys = {algorithm: {o.key for o in options} for algorithm, options in OPTIONS.items()}
    for index, group in enumerate(groups):
        algorithm = group.get("algorithm")
        if algorithm not in keys:
            return  # a changed algorithm is refused by name (muon_dist.step.changes)
        where = f"param group {index} ({algorithm})"
        own = keys[algorithm] | {"algorithm"}
        # The other algorithm's options pass: torch's schedulers cycle Muon's "momentum"
        # (the optimizer's defaults) on every group, AdamW's included, which ignore it.
        check_group_keys(group, own | keys["adamw" if algorithm == "muon" else "muon"], (), where)
        missing = sorted(own - set(group))
        if missing:
            raise ValueError(
                f"{where}: {', '.join(map(repr, missing))} removed from the group since the "
                "optimizer was built; every option is read by the step: set it back"
            )
        check_options(group, where, per_step=True)
