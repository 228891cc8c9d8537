"""A param group's life in the optimizer: checked on the way in, given its state, saved,
and loaded back.

:class:`muon_dist.Muon` calls these from ``add_param_group``, ``state_dict`` and
``load_state_dict``; the rank agreement around them stays in the optimizer. Nothing here
talks to other ranks, so a refusal can be agreed before anything changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from muon_dist.options.schema import (
    LAYOUT_STATE,
    MOMENTUM_DTYPES,
    check_options,
    missing_filled,
)
from muon_dist.options.settings import STARTS_IN_BACKWARD
from muon_dist.options.validation import check_group_keys, check_unique_names, validate_group
from muon_dist.plan.views import ALGORITHMS, group_param_names, matrix_views, param_list
from muon_dist.rules.registry import fp32_state, rule_of
from muon_dist.state.checks import (
    by_name,
    check_hookable,
    check_saved_routing,
    check_saved_state,
    matrix_count,
)
from muon_dist.state.flat import own_copy, zeros_like_flat
from muon_dist.state.tensors import local

logger = logging.getLogger(__name__)

Defaults = dict[str, dict[str, Any]]
State = dict[torch.Tensor, dict[str, Any]]

# State tensors a load copies into rather than replaces (momenta are views of one buffer).
OWN_TENSORS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
# State kept in fp32 whatever the parameter's dtype (torch's load casts to the parameter's).
FP32_TENSORS = ("magma_score", *fp32_state())


def _other(algorithm: str) -> str:
    return "adamw" if algorithm == "muon" else "muon"


def checked_group(
    param_group: dict[str, Any], groups: list[dict[str, Any]], defaults: Defaults, overlap: str
) -> dict[str, Any]:
    """``param_group`` with its algorithm's defaults filled in, every option, parameter and
    name checked against the ``groups`` already there; nothing changes here."""
    algorithm = param_group.get("algorithm", "muon")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; choose one of {ALGORITHMS}")
    where = f"param group {len(groups)} ({algorithm})"
    check_group_keys(param_group, defaults[algorithm], defaults[_other(algorithm)], where)
    group = {**defaults[algorithm], **param_group, "params": param_list(param_group["params"])}
    validate_group(group, len(groups))
    check_unique_names(groups, group)
    if algorithm == "muon" and overlap in STARTS_IN_BACKWARD:
        check_hookable(group["params"], group_param_names(group, len(groups)), overlap)
    group.setdefault("steps", 0)
    group.setdefault("skipped_steps", 0)
    return group


def momentum_dtype(group: dict[str, Any], p: torch.Tensor) -> torch.dtype:
    """The dtype a Muon parameter's momentum is stored in: its group's ``momentum_dtype``,
    else the parameter's own."""
    name = group["momentum_dtype"]
    return local(p).dtype if name is None else MOMENTUM_DTYPES[name]


def momenta_like(group: dict[str, Any]) -> list[torch.Tensor]:
    """Zero momenta for a Muon group's parameters, in one flat buffer per dtype and device
    (so the step stores them in one pass), each in :func:`momentum_dtype`."""
    params = group["params"]
    return zeros_like_flat(params, [momentum_dtype(group, p) for p in params])


def init_state(group: dict[str, Any], index: int, state: State) -> None:
    """The state of group ``index``'s parameters: Muon's momenta (:func:`momenta_like`),
    Magma scores and NorMuon row moments; AdamW's step and moments."""
    names = group_param_names(group, index)
    muon = group["algorithm"] == "muon"
    momenta = momenta_like(group) if muon else []
    for at, (p, name) in enumerate(zip(group["params"], names, strict=True)):
        entry = state[p]
        device = local(p).device
        if not muon:
            entry["step"] = torch.tensor(0.0, device=device)
            entry["exp_avg"] = torch.zeros_like(p)
            entry["exp_avg_sq"] = torch.zeros_like(p)
            continue
        entry["momentum_buffer"] = momenta[at]
        entry.update(fresh_layout_state(group, p, name))


def fresh_layout_state(group: dict[str, Any], p: torch.Tensor, name: str) -> dict[str, Any]:
    """A new Muon parameter's state besides its momentum: what ``magma`` and the ``rule``
    add (Magma's scores at one, NorMuon's row moments at zero)."""
    device = local(p).device
    entry = {}
    if group["magma"]:
        entry["magma_score"] = torch.ones(matrix_count(group, p, name), device=device)
    for key, shape in rule_of(group).state_shapes(matrix_views(p.shape, group, name)).items():
        entry[key] = torch.zeros(shape, device=device)
    return entry


def saved_copies(saved: dict[str, Any]) -> dict[str, Any]:
    """torch's ``state_dict`` with momenta as copies: views into the flat buffer at an
    offset are DTensors torch cannot pickle, so ``torch.save(opt.state_dict())`` works."""
    saved["state"] = {
        key: {k: own_copy(v) if k == "momentum_buffer" else v for k, v in entry.items()}
        for key, entry in saved["state"].items()
    }
    return saved


def checked_load(
    state_dict: dict[str, Any], groups: list[dict[str, Any]], defaults: Defaults
) -> dict[str, Any]:
    """``state_dict`` arranged in this optimizer's order by name, every part checked as the
    constructor checks its groups, every state entry and tensor checked; a group saved
    under another ``rule``, ``magma`` or ``momentum_dtype`` is converted to this
    optimizer's (:func:`layout_converted`)."""
    state_dict, converted = layout_converted(state_dict, groups)
    check_saved_routing(state_dict, groups)
    loaded = by_name(state_dict, groups)
    for index, (saved, group) in enumerate(zip(loaded["param_groups"], groups, strict=True)):
        algorithm = group["algorithm"]
        where = f"load_state_dict: saved param group {index} ({algorithm})"
        check_group_keys(saved, defaults[algorithm], defaults[_other(algorithm)], where)
        saved = loaded["param_groups"][index] = missing_filled(saved, algorithm)
        options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        validate_group({**group, **options}, index)
    check_saved_state(loaded, groups)
    for line in converted:
        logger.warning("muon_dist.Muon.load_state_dict: %s", line)
    return loaded


def layout_converted(
    state_dict: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[str]]:
    """``state_dict`` with every Muon group saved under another ``rule``, ``magma`` or
    ``momentum_dtype`` than this optimizer's group at its index converted to this one's,
    and a line saying so per group. They are fixed once an optimizer is built, so changing
    one is building a new optimizer with it and loading the old state: the momenta carry
    over, the state the new value adds starts as in a new optimizer (NorMuon's row moments
    at zero, Magma's scores at one), and the state it does not keep is dropped; a
    momentum saved in another dtype is cast when it is copied into this optimizer's
    (:func:`restore_after_load`). Nothing of ``state_dict`` changes in place; what does
    not fit otherwise is refused by the checks that follow."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list):
        return state_dict, []
    state = dict(state_dict.get("state", {}))
    converted: list[dict[str, Any]] = []
    lines: list[str] = []
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=False)):
        muon = isinstance(saved, dict) and saved.get("algorithm") == group["algorithm"] == "muon"
        filled = missing_filled(saved, "muon") if muon else {}
        changed = {k: filled[k] for k in LAYOUT_STATE if muon and filled[k] != group[k]}
        if not changed:
            converted.append(saved)
            continue
        check_options(filled, f"load_state_dict: saved param group {index} (muon)", False)
        before = {**group, **changed}
        names = saved.get("param_names") or group_param_names(group, index)
        current = dict(zip(group_param_names(group, index), group["params"], strict=True))
        for name, key in zip(names, saved.get("params", []), strict=False):
            p = current.get(name)
            if p is None or key not in state:
                continue
            old = fresh_layout_state(before, p, name)
            entry = {k: v for k, v in state[key].items() if k not in old}
            state[key] = {**fresh_layout_state(group, p, name), **entry}
        converted.append({**saved, **{k: group[k] for k in changed}})
        lines.append(
            f"param group {index} was saved with "
            + ", ".join(f"{k}={v!r}" for k, v in changed.items())
            + " and is loaded as this optimizer's "
            + ", ".join(f"{k}={group[k]!r}" for k in changed)
            + ": its momenta carry over, "
            + "; ".join(dict.fromkeys(LAYOUT_STATE[k] for k in changed))
        )
    converted += saved_groups[len(converted) :]
    return {**state_dict, "state": state, "param_groups": converted}, lines


def held_before_load(
    state: State, loaded: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[State, State]:
    """What torch's ``load_state_dict`` would lose, taken before it runs: this optimizer's
    own tensors (loaded values are copied into them) and the loaded fp32 tensors (torch
    casts them to the parameter's dtype)."""
    own = {p: {k: v for k, v in entry.items() if k in OWN_TENSORS} for p, entry in state.items()}
    params = [p for g in groups for p in g["params"]]
    fp32 = {
        p: {k: v for k, v in loaded["state"][i].items() if k in FP32_TENSORS}
        for i, p in enumerate(params)
    }
    return own, fp32


def restore_after_load(state: State, own: State, fp32: State, groups: list[dict[str, Any]]) -> None:
    """Put loaded values into the optimizer's own tensors, fp32 tensors back in fp32, and
    AdamW's step next to its moments (torch keeps it on the host; fused AdamW does not)."""
    for p, tensors in own.items():
        for key, mine in tensors.items():
            value = local(state[p][key])
            if value.data_ptr() != local(mine).data_ptr():
                local(mine).copy_(value)
            state[p][key] = mine
    for p, tensors in fp32.items():
        for key, value in tensors.items():
            state[p][key] = value.to(local(p).device, torch.float32, copy=True)
    for group in groups:
        if group["algorithm"] == "adamw":
            for p in group["params"]:
                step = torch.as_tensor(state[p]["step"])
                state[p]["step"] = step.to(local(p).device, torch.float32, copy=True)
