"""Group edits between steps (``opt.param_groups[i][key] = ...``): an option read when the
step is built rebuilds it, exactly as a new optimizer with that option and this one's state
would step; an edit the state cannot follow is refused by name, changing nothing.
(Edits between backward and step under the overlap: test_backward_overlap.py; on one rank
only: trust_cases.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import muon_dist

FP32 = {"ns_dtype": torch.float32, "comm_dtype": torch.float32}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16, bias=False), nn.Linear(16, 8, bias=True))


def _step(model: nn.Module, opt: muon_dist.Muon, seed: int) -> None:
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ns_steps", 3),
        ("coefficients", "polar_express"),
        ("adjust_lr", "rms_norm"),
        ("ns_method", "standard"),
        ("cautious_wd", True),
    ],
)
def test_an_option_read_when_built_is_followed(key: str, value: Any) -> None:
    """Two steps, the option changed, two more: equal to an optimizer built with the new
    option and loaded with the state after two steps."""
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), weight_decay=0.1, **FP32)
    for seed in range(2):
        _step(model, opt, seed)
    saved = copy.deepcopy(opt.state_dict())  # AdamW's moments are live tensors
    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt.param_groups[0][key] = value
    for seed in range(2, 4):
        _step(model, opt, seed)

    saved["param_groups"][0][key] = value
    fresh = muon_dist.Muon(twin.named_parameters(), weight_decay=0.1, **FP32)
    fresh.load_state_dict(saved)
    for seed in range(2, 4):
        _step(twin, fresh, seed)
    for a, b in zip(_params(model), _params(twin), strict=True):
        assert torch.equal(a, b)


def test_a_list_edited_in_place_is_followed() -> None:
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), coefficients=[[3.0, -3.2, 1.2]] * 5, **FP32)
    _step(model, opt, 0)
    before = opt.runner
    opt.param_groups[0]["coefficients"][0] = [3.4445, -4.775, 2.0315]
    _step(model, opt, 1)
    assert opt.runner is not before


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda opt, _model: opt.param_groups[0].update(rule="normuon"),
            r"param group 0 rule changed from 'muon' to 'normuon' since the optimizer was "
            r"built; rule decides the matrix views or the state's layout: build a new",
        ),
        (
            lambda opt, _model: opt.param_groups[0].update(magma=True),
            r"param group 0 magma changed from False to True",
        ),
        (
            lambda opt, _model: opt.param_groups[0]["params"].append(
                nn.Parameter(torch.ones(4, 4))
            ),
            r"param group 0 'params' changed since the optimizer was built \(1 added, 0 removed",
        ),
        (
            lambda opt, _model: opt.param_groups[0]["params"].pop(),
            r"\(0 added, 1 removed, or reordered\).*opt\.add_param_group",
        ),
        (
            lambda opt, _model: opt.param_groups.append(dict(opt.param_groups[1])),
            r"opt\.param_groups has 3 groups, and the optimizer was built with 2",
        ),
        (
            lambda opt, _model: opt.param_groups[1].update(algorithm="muon"),
            r"param group 1 algorithm changed from 'adamw' to 'muon'",
        ),
    ],
    ids=["rule", "magma", "param added", "param removed", "group appended", "algorithm"],
)
def test_an_edit_the_state_cannot_follow_is_refused(edit: Any, message: str) -> None:
    """Refused by name at the next step, nothing changed and the step not counted; the
    state still loads into a new optimizer."""
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), **FP32)
    _step(model, opt, 0)
    groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    before = _params(model)
    edit(opt, model)
    with pytest.raises(ValueError, match=message):
        _step(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
    opt.param_groups[:] = [opt.param_groups[i] for i in range(len(groups))]
    for group, kept in zip(opt.param_groups, groups, strict=True):
        group.clear()
        group.update(kept)
    assert [g["steps"] for g in opt.param_groups] == [1, 1]
    _step(model, opt, 1)
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
    fresh = muon_dist.Muon(_model().named_parameters(), **FP32)
    fresh.load_state_dict(opt.state_dict())


def test_a_bad_value_of_an_option_read_when_built_is_refused_by_name() -> None:
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), **FP32)
    _step(model, opt, 0)
    opt.param_groups[0]["ns_steps"] = 0
    with pytest.raises(ValueError, match=r"param group 0 \(muon\).*ns_steps"):
        _step(model, opt, 1)
