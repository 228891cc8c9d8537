"""Which group edits a step notices without checking the groups again
(:class:`muon_dist.step.changes.GroupWatch`): every change the full checks would see, and
nothing else but the lr and the step counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.step.changes import GroupWatch

SKIPPED = frozenset({"lr", "initial_lr", "steps", "skipped_steps"})


def _groups() -> list[dict[str, Any]]:
    params = [nn.Parameter(torch.ones(2, 2)) for _ in range(3)]
    return [
        {
            "params": params[:2],
            "param_names": ["a", "b"],
            "lr": 0.02,
            "initial_lr": 0.02,
            "momentum": 0.95,
            "ns_steps": 5,
            "coefficients": [[3.0, -3.2, 1.2]],
            "betas": (0.9, 0.95),
            "ns_dtype": torch.bfloat16,
            "steps": 0,
        },
        {"params": params[2:], "param_names": ["c"], "lr": 3e-4, "weight_decay": 0.0},
    ]


Edit = Callable[[list[dict[str, Any]]], None]


def _set(key: str, value: Any) -> Edit:
    return lambda groups: groups[0].__setitem__(key, value)


UNCHANGED: dict[str, Edit] = {
    "nothing": lambda groups: None,
    "lr (a scheduler)": _set("lr", 0.01),
    "step counts": _set("steps", 7),
    "initial_lr (a scheduler's)": _set("initial_lr", 0.01),
    "an equal float, another object": _set("momentum", float("0.95")),
    "an equal tuple, another object": _set("betas", (0.9, 0.95)),
    "an equal list, another object": _set("coefficients", [[3.0, -3.2, 1.2]]),
    "equal names, another list": _set("param_names", ["a", "b"]),
}

CHANGED: dict[str, Edit] = {
    "an option": _set("momentum", 0.9),
    "an int for a float of equal value": _set("momentum", 1),
    "-0.0 for 0.0": lambda groups: groups[1].__setitem__("weight_decay", -0.0),
    "NaN": _set("momentum", float("nan")),
    "a dtype": _set("ns_dtype", torch.float32),
    "a list edited in place": lambda groups: groups[0]["coefficients"][0].__setitem__(0, 3.4),
    "a parameter appended": lambda groups: groups[0]["params"].append(nn.Parameter(torch.ones(1))),
    "a parameter replaced": lambda groups: groups[0]["params"].__setitem__(
        0, nn.Parameter(torch.ones(2, 2))
    ),
    "parameters reordered": lambda groups: groups[0]["params"].reverse(),
    "a name edited in place": lambda groups: groups[0]["param_names"].__setitem__(0, "z"),
    "a key added": _set("weight_decy", 0.1),
    "a key removed": lambda groups: groups[0].pop("ns_steps"),
    "a group dict replaced": lambda groups: groups.__setitem__(0, dict(groups[0])),
    "a group appended": lambda groups: groups.append(dict(groups[1])),
}


def _edited(edit: Edit) -> tuple[list[dict[str, Any]], GroupWatch]:
    """Groups recorded by a new watch, then edited by ``edit``."""
    groups = _groups()
    watch = GroupWatch(SKIPPED)
    watch.record(groups)
    edit(groups)
    return groups, watch


@pytest.mark.parametrize("name", UNCHANGED)
def test_what_needs_no_checks_again(name: str) -> None:
    groups, watch = _edited(UNCHANGED[name])
    assert watch.unchanged(groups)


@pytest.mark.parametrize("name", CHANGED)
def test_every_change_the_checks_would_see_is_noticed(name: str) -> None:
    groups, watch = _edited(CHANGED[name])
    assert not watch.unchanged(groups)
    watch.record(groups)  # checked again: unchanged from then on
    assert watch.unchanged(groups)
    assert watch.edits == 2


def test_groups_never_checked_are_changed() -> None:
    assert not GroupWatch(SKIPPED).unchanged(_groups())


def _model_and_opt() -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.Linear(16, 8, bias=True))
    return model, muon_dist.Muon(model.named_parameters(), ns_dtype=torch.float32)


def _step(model: nn.Module, opt: muon_dist.Muon) -> None:
    opt.zero_grad()
    model(torch.randn(5, 12)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("lr", float("nan"), "lr"),
        ("momentum", 1.0, "momentum"),
        ("weight_decy", 0.1, "weight_decay"),
    ],
)
def test_a_bad_edit_after_unchecked_steps_is_refused(key: str, value: Any, words: str) -> None:
    """Steps that skipped the checks still refuse a bad value, by name, changing nothing."""
    model, opt = _model_and_opt()
    for _ in range(3):
        _step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    old = opt.param_groups[0].get(key)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=words):
        _step(model, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    if old is None:
        del opt.param_groups[0][key]
    else:
        opt.param_groups[0][key] = old
    _step(model, opt)


def test_a_group_of_parameters_and_lr_alone() -> None:
    groups: list[dict[str, Any]] = [{"params": [nn.Parameter(torch.ones(1))], "lr": 0.1}]
    watch = GroupWatch(SKIPPED)
    watch.record(groups)
    groups[0]["lr"] = 0.2
    assert watch.unchanged(groups)
    groups[0]["params"].append(nn.Parameter(torch.ones(1)))
    assert not watch.unchanged(groups)
