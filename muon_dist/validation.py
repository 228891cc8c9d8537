"""Checks of param groups and their parameters, run before anything changes.

The constructor (through ``add_param_group``) and ``load_state_dict`` run the same checks,
so a saved ``lr=nan`` or ``momentum=1.5`` is refused as a constructed one is. Each error
names the group, the key (or parameter), the value and the fix.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from muon_dist.kernels.coefficients import resolve_coefficients
from muon_dist.kernels.gram import METHODS as NS_METHODS
from muon_dist.routing import ADJUST_LR, MUON_MODES, group_param_names, matrix_views
from muon_dist.update_rule import RULES

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
    a value (``num_heads`` on an AdamW group), or a misspelling (``weight_decy``, with the
    closest key suggested). ``own`` and ``other`` are the keys of each algorithm."""
    allowed = set(own) | BOOKKEEPING_KEYS
    foreign = set(other) - allowed
    algorithm = group.get("algorithm", "muon")
    for key, value in group.items():
        if key in allowed:
            continue
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


def _number(where: str, key: str, value: Any) -> float:
    """A finite real number given as a Python or NumPy int or float. A tensor, a bool, a
    string, a ``Decimal`` or a ``Fraction`` is refused: fused AdamW and the device staging
    of the step read plain numbers, and would fail mid-step on anything else."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{where}: {key} is a tensor ({value!r}); pass a Python float "
            f"(e.g. {key}={float(value.detach().cpu().reshape(-1)[0])}): the step stages "
            "every group's hyper-parameters into device memory itself"
        )
    if not is_real(value):
        raise TypeError(
            f"{where}: {key}={value!r} is a {type(value).__name__}; pass a Python int or "
            f"float (e.g. {key}=float(...))"
        )
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key}={value!r} is not finite; pass a finite number")
    return float(value)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number as the options take them: an int or a float
    (NumPy's included), never a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def count(where: str, key: str, value: Any, low: int) -> int:
    """An int (not a bool, not a float with an integral value) of at least ``low``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{where}: {key}={value!r} is a {type(value).__name__}; pass an int >= {low}"
        )
    if value < low:
        raise ValueError(f"{where}: {key}={value!r} must be >= {low}")
    return int(value)


def _at_least(where: str, key: str, value: Any, low: float) -> None:
    if _number(where, key, value) < low:
        raise ValueError(f"{where}: {key}={value!r} must be >= {low}")


def _in_unit(where: str, key: str, value: Any) -> None:
    """``value`` in [0, 1), as momentum and betas must be."""
    if not 0.0 <= _number(where, key, value) < 1.0:
        raise ValueError(f"{where}: {key}={value!r} is out of range; it must lie in [0.0, 1.0)")


def _flag(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r}; choose True or False")


def validate_group(group: dict[str, Any], index: int) -> None:
    """Check every option of a full group (its algorithm's defaults filled in)."""
    where = f"param group {index} ({group['algorithm']})"
    _check_step_options(group, where)
    if group["algorithm"] == "muon":
        _validate_muon(group, where)
    _validate_params(group, index, where)


def _check_step_options(group: dict[str, Any], where: str) -> None:
    """The options a scheduler or the user may change between steps."""
    _at_least(where, "lr", group["lr"], 0.0)
    _at_least(where, "weight_decay", group["weight_decay"], 0.0)
    if group["algorithm"] == "muon":
        _in_unit(where, "momentum", group["momentum"])
        _flag(where, "nesterov", group["nesterov"])
        return
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas={betas!r} must be a pair (beta1, beta2)")
    _in_unit(where, "betas[0]", betas[0])
    _in_unit(where, "betas[1]", betas[1])
    _at_least(where, "eps", group["eps"], 0.0)


def _validate_muon(group: dict[str, Any], where: str) -> None:
    if group["adjust_lr"] not in ADJUST_LR:
        raise ValueError(
            f"{where}: adjust_lr={group['adjust_lr']!r} is not supported; choose one of {ADJUST_LR}"
        )
    if group["muon_mode"] not in MUON_MODES:
        raise ValueError(
            f"{where}: muon_mode={group['muon_mode']!r} is not supported; "
            f"choose one of {MUON_MODES}"
        )
    try:
        schedule = resolve_coefficients(group["coefficients"], group["ns_steps"])
        for k, triple in enumerate(schedule.steps):
            for value in triple:
                _number(where, f"coefficients[{k}]", value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(
            f"{where}: ns_method={group['ns_method']!r} is not supported; choose one of "
            f"{list(NS_METHODS)}"
        )
    for key in ("magma", "cautious_wd"):
        _flag(where, key, group[key])
    _in_unit(where, "magma_beta", group["magma_beta"])
    if group["rule"] not in RULES:
        raise ValueError(
            f"{where}: rule={group['rule']!r} is not supported; choose one of {list(RULES)}"
        )
    fraction = _number(where, "dion2_fraction", group["dion2_fraction"])
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"{where}: dion2_fraction={group['dion2_fraction']!r} is out of range; it must "
            "lie in (0.0, 1.0] (the share of each matrix's slices Dion2 orthogonalizes; "
            "0.25 is the paper's choice, 1.0 is Muon)"
        )
    if group["rule"] == "dion2":
        for key in ("magma", "cautious_wd"):
            if group[key]:
                raise ValueError(
                    f"{where}: {key}=True with rule='dion2'; Dion2 updates only its selected "
                    f"slices, which {key} does not account for: set {key}=False in this "
                    "group or use rule='muon'"
                )
    _in_unit(where, "normuon_beta2", group["normuon_beta2"])
    if _number(where, "normuon_eps", group["normuon_eps"]) <= 0.0:
        raise ValueError(
            f"{where}: normuon_eps={group['normuon_eps']!r} must be > 0 (e.g. 1e-8): it "
            "keeps a row whose second moment is zero from dividing by zero"
        )


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


def check_step_values(groups: Sequence[dict[str, Any]]) -> None:
    """The options a scheduler or the user may change between steps, checked at each step
    (a few comparisons per group): ``momentum=1.0`` or a NaN lr is refused by name before
    anything changes, instead of surfacing as an overflow or a non-finite result."""
    for index, group in enumerate(groups):
        _check_step_options(group, f"param group {index} ({group['algorithm']})")
