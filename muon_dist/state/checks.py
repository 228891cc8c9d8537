"""Checks that fail fast with a clear message instead of corrupting a run: a saved state
matches the current routing and holds usable tensors.
(Agreement across ranks is :mod:`muon_dist.comm.consensus`.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from muon_dist.plan.views import group_param_names, matrix_views, named_params
from muon_dist.rules.registry import rule_of
from muon_dist.state.tensors import local

# Group keys that decide a Muon parameter's matrix views: a saved state built under other
# values holds momenta of other matrices, so loading it is refused.
ROUTING_KEYS = (
    "muon_mode",
    "experts",
    "num_experts",
    "num_heads",
    "split_sizes",
    "split_groups",
    "transposed",
)


def matrix_count(group: dict[str, Any], p: torch.Tensor, name: str) -> int:
    """How many matrices a Muon parameter is cut into (Magma keeps one score each)."""
    return sum(v.count for v in matrix_views(p.shape, group, name))


def state_shapes(group: dict[str, Any], p: torch.Tensor, name: str) -> dict[str, tuple[int, ...]]:
    """The state this optimizer keeps for ``p`` (besides AdamW's step), with shapes."""
    if group["algorithm"] == "adamw":
        return {"exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
    shapes = {"momentum_buffer": tuple(p.shape)}
    if group["magma"]:
        shapes["magma_score"] = (matrix_count(group, p, name),)
    shapes.update(rule_of(group).state_shapes(matrix_views(p.shape, group, name)))
    return shapes


def _with_names(saved: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
    """A saved group, named after the current group at its index when it lost its names
    (torchtitan's flat, name-keyed checkpoints come back without them) and sizes agree."""
    names = (current or {}).get("param_names")
    if "param_names" in saved or names is None or len(names) != len(saved["params"]):
        return saved
    return {**saved, "param_names": names}


def _saved_groups(
    state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The saved groups, each named (see :func:`_with_names`); refuses a foreign state."""
    saved_groups = state_dict.get("param_groups", [])
    for index, saved in enumerate(saved_groups):
        if "algorithm" not in saved:
            raise ValueError(
                f"saved param group {index} has no 'algorithm' key (it has "
                f"{sorted(k for k in saved if k != 'params')}): this state was not saved by "
                "muon_dist.Muon (a torch.optim.AdamW or SGD state?); load it into the "
                "optimizer class that saved it, or start this optimizer fresh"
            )
    return [
        _with_names(saved, groups[i] if i < len(groups) else None)
        for i, saved in enumerate(saved_groups)
    ]


def check_saved_routing(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Name every parameter whose saved algorithm, group, matrix views (``muon_mode`` and
    the other routing keys), state keys or state shapes differ from now."""
    saved_groups = _saved_groups(state_dict, groups)
    saved = _saved_by_name(state_dict, saved_groups)
    current = {
        name: (index, group, p)
        for index, group in enumerate(groups)
        for name, p in zip(group_param_names(group, index), group["params"], strict=True)
    }
    problems = [f"{name}: in the saved state, absent now" for name in saved if name not in current]
    for name, (index, group, p) in current.items():
        if name not in saved:
            problems.append(f"{name}: absent from the saved state")
        else:
            problems += _param_problems(name, index, group, p, *saved[name])
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if not problems and saved_sizes != [len(g["params"]) for g in groups]:
        problems.append(f"param group sizes {saved_sizes} were saved; rebuild the same groups")
    if problems:
        raise ValueError(
            "the saved optimizer state does not match this optimizer's routing:\n  "
            + "\n  ".join(problems)
        )


def _saved_by_name(
    state_dict: dict[str, Any], saved_groups: Sequence[dict[str, Any]]
) -> dict[str, tuple[int, dict[str, Any], dict[str, Any]]]:
    """Each saved parameter by name: its group index, group and state."""
    saved: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {}
    for index, group in enumerate(saved_groups):
        for name, key in zip(group_param_names(group, index), group["params"], strict=True):
            if name in saved:
                raise ValueError(
                    f"the saved optimizer state holds two parameters named {name!r} (saved "
                    f"param groups {saved[name][0]} and {index}); state is matched by name, so "
                    "their momenta and moments cannot be told apart: it was saved by an "
                    "optimizer whose names collide (this version refuses those); start fresh, "
                    "or rename the saved param_names to what each parameter is called now"
                )
            saved[name] = (index, group, state_dict["state"].get(key, {}))
    return saved


def _param_problems(
    name: str,
    index: int,
    group: dict[str, Any],
    p: torch.Tensor,
    saved_index: int,
    saved_group: dict[str, Any],
    state: dict[str, Any],
) -> list[str]:
    """What differs between a parameter now and as saved (the first difference found)."""
    algorithm = group["algorithm"]
    if saved_group["algorithm"] != algorithm:
        return [f"{name}: saved as {saved_group['algorithm']}, routed to {algorithm} now"]
    if saved_index != index:
        return [
            f"{name}: in saved param group {saved_index}, in group {index} now; "
            "build the groups as they were when saving"
        ]
    changed = [
        f"{key}={saved_group[key]!r} when saved, {group.get(key)!r} now"
        for key in ROUTING_KEYS
        if algorithm == "muon" and key in saved_group and saved_group[key] != group.get(key)
    ]
    if changed:
        return [
            f"{name}: {'; '.join(changed)}; its momentum belongs to other matrices: "
            "construct the optimizer with the saved values, or start it fresh"
        ]
    shapes = state_shapes(group, p, name)
    kept = set(state) - {"step"}
    if state and kept != set(shapes):
        return [
            f"{name}: saved state has {sorted(kept)}, this optimizer keeps "
            f"{sorted(shapes)}; set magma and rule as they were when saving"
        ]
    return [
        f"{name}: saved {key} has shape {tuple(value.shape)}, this optimizer keeps {shapes[key]}"
        for key, value in state.items()
        if key != "step" and tuple(value.shape) != shapes[key]
    ]


def by_name(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The saved state rearranged into this optimizer's parameter order, matched by name.

    ``Optimizer.load_state_dict`` pairs saved and current parameters by position; after a
    model lists same-shape parameters in another order that would swap their state. Call
    after :func:`check_saved_routing`, which makes the names and groups correspond.
    """
    saved_groups = _saved_groups(state_dict, groups)
    key_of = {name: key for name, _, key in named_params(saved_groups)}
    state: dict[int, Any] = {}
    new_groups = []
    position = 0
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        names = group_param_names(group, index)
        ids = []
        for name in names:
            if key_of[name] in state_dict["state"]:
                state[position] = state_dict["state"][key_of[name]]
            ids.append(position)
            position += 1
        renamed = {**saved, "params": ids}
        if "param_names" in saved:
            renamed["param_names"] = names
        new_groups.append(renamed)
    return {**state_dict, "state": state, "param_groups": new_groups}


def check_saved_state(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Every per-parameter entry of a state already arranged by name (:func:`by_name`):
    present, holding this optimizer's keys, tensors that are finite and, for momenta, shaped
    like this rank's shard. Refuses before anything is replaced, naming the parameters."""
    problems = []
    for position, (name, group, p) in enumerate(named_params(groups)):
        state = state_dict["state"].get(position)
        if not state:
            problems.append(f"{name}: no state was saved for it")
            continue
        expected = set(state_shapes(group, p, name))
        if group["algorithm"] == "adamw":
            expected.add("step")
        if set(state) != expected:
            problems.append(f"{name}: saved state has {sorted(state)}, expected {sorted(expected)}")
            continue
        for key, value in state.items():
            problem = _saved_value_problem(key, value, p)
            if problem:
                problems.append(f"{name}: {problem}")
    if problems:
        raise ValueError(
            "load_state_dict: the saved state cannot be loaded, nothing was changed:\n  "
            + "\n  ".join(problems)
        )


def _saved_value_problem(key: str, value: Any, p: torch.Tensor) -> str | None:
    """What is wrong with one saved state value, or None."""
    if key == "step" and not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"saved step={value!r} is not a number"
        return None if math.isfinite(value) else f"saved step={value!r} is not finite"
    if not isinstance(value, torch.Tensor):
        return f"saved {key} is a {type(value).__name__}, not a tensor"
    if not bool(torch.isfinite(local(value)).all()):
        return (
            f"saved {key} holds non-finite values (NaN or inf); every step from it would be "
            "non-finite: load an earlier checkpoint"
        )
    if key == "momentum_buffer" and local(value).shape != local(p).shape:
        return (
            f"the saved momentum holds a local shard of shape {tuple(local(value).shape)}, "
            f"where this rank's shard of the parameter is {tuple(local(p).shape)}; load a "
            "state saved on the same mesh, or go through torch.distributed.checkpoint, which "
            "reshards"
        )
    return None


def check_hookable(params: Sequence[torch.Tensor], names: Sequence[str], overlap: str) -> None:
    """Refuse plain tensors under an ``overlap`` that starts steps from gradient hooks: their
    hook fires when autograd accumulates the local gradient, before DDP (or any
    data-parallel wrapper) reduces it across ranks."""
    for p, name in zip(params, names, strict=True):
        if not isinstance(p, DTensor):
            raise ValueError(
                f"overlap={overlap!r}: {name} is a plain tensor; its gradient hook fires "
                "before a data-parallel wrapper reduces the gradient, so Newton-Schulz "
                "would start from a partial gradient. Shard the model with fully_shard "
                "(FSDP2 calls the hook after the reduction), or use overlap='none'"
            )
