"""Group edits between steps (``opt.param_groups[i][key] = ...``): an option read when the
step is built rebuilds it, exactly as a new optimizer with that option and this one's state
would step; an edit the state cannot follow is refused by name, changing nothing.
(Edits between backward and step under the overlap: test_backward_overlap.py; on one rank
only: trust_cases.py.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
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


def _set(key: str, value: Any, group: int = 0) -> Callable[[muon_dist.Muon], None]:
    return lambda opt: opt.param_groups[group].__setitem__(key, value)


def _rebuilt(**options: Any) -> Callable[[muon_dist.Muon, nn.Module], muon_dist.Muon]:
    """The advice "build a new muon_dist.Muon with it and load this one's state"."""

    def fix(opt: muon_dist.Muon, model: nn.Module) -> muon_dist.Muon:
        new = muon_dist.Muon(model.named_parameters(), **FP32, **options)
        new.load_state_dict(opt.state_dict())
        for p in model.parameters():  # the momenta carry over (cast to a new dtype)
            for key, value in opt.state[p].items():
                if key in new.state[p] and key not in ("magma_score", "row_second_moment"):
                    mine = new.state[p][key]
                    assert torch.equal(mine, value.to(mine.dtype)), key
        return new

    return fix


def _fresh(**options: Any) -> Callable[[muon_dist.Muon, nn.Module], muon_dist.Muon]:
    """The advice "build a new muon_dist.Muon with it, whose state starts fresh"."""
    return lambda _opt, model: muon_dist.Muon(model.named_parameters(), **FP32, **options)


def _added_group(opt: muon_dist.Muon, _model: nn.Module) -> muon_dist.Muon:
    opt.add_param_group({"params": [nn.Parameter(torch.ones(4, 4))], "param_names": ["extra"]})
    return opt


# Each edit the state cannot follow: the refusal's words, and the fix it names, run. Every
# fix first sets the edit back (as each message says), then does what else it names.
REFUSED: dict[str, tuple[Callable[[muon_dist.Muon], None], str, Any]] = {
    "rule": (
        _set("rule", "normuon"),
        r"param group 0 rule changed from 'muon' to 'normuon' since the optimizer was built; "
        r"rule decides the matrix views or the state's layout: set it back, then build a new "
        r"muon_dist.Muon with rule='normuon' and load this one's state",
        _rebuilt(rule="normuon"),
    ),
    "magma": (
        _set("magma", True),
        r"param group 0 magma changed from False to True.*set it back, then build a new "
        r"muon_dist.Muon with magma=True and load this one's state",
        _rebuilt(magma=True),
    ),
    "momentum_dtype": (
        _set("momentum_dtype", "bf16"),
        r"param group 0 momentum_dtype changed from None to 'bf16'.*set it back, then build "
        r"a new muon_dist.Muon with momentum_dtype='bf16' and load this one's state",
        _rebuilt(momentum_dtype="bf16"),
    ),
    "muon_mode": (
        _set("muon_mode", "flat"),
        r"muon_mode changed from '2d' to 'flat'.*set it back, then build a new "
        r"muon_dist.Muon with muon_mode='flat', whose state starts fresh",
        _fresh(muon_mode="flat"),
    ),
    "param added": (
        lambda opt: opt.param_groups[0]["params"].append(nn.Parameter(torch.ones(4, 4))),
        r"param group 0 'params' changed since the optimizer was built \(1 added, 0 removed.*"
        r"set the list back, then add parameters with opt\.add_param_group",
        _added_group,
    ),
    "param removed": (
        lambda opt: opt.param_groups[0]["params"].pop(),
        r"\(0 added, 1 removed, or reordered\).*set the list back.*or build a new "
        r"muon_dist.Muon over the parameters you want",
        _fresh(),
    ),
    "group appended": (
        lambda opt: opt.param_groups.append(dict(opt.param_groups[1])),
        r"opt\.param_groups has 3 groups, and the optimizer was built with 2: add groups "
        r"with opt\.add_param_group",
        _added_group,
    ),
    "algorithm": (
        _set("algorithm", "muon", group=1),
        r"param group 1 algorithm changed from 'adamw' to 'muon'.*set it back, or build a "
        r"new muon_dist.Muon with the groups you want",
        _fresh(),
    ),
    "param_names": (
        _set("param_names", ["a", "b"]),
        r"param group 0 'param_names' changed since the optimizer was built.*set them back",
        None,
    ),
    "overlap": (
        _set("overlap", "none"),
        r"param group 0 \(muon\): overlap='none' is a setting of the whole optimizer, not of "
        r"a group.*remove the key and build a new muon_dist.Muon\(\.\.\., overlap='none'\), "
        r"then new.load_state_dict\(opt.state_dict\(\)\)",
        _rebuilt(overlap="none"),
    ),
    "unknown key": (
        _set("weight_decy", 0.1),
        r"param group 0 \(muon\): unknown group key 'weight_decy'; did you mean "
        r"'weight_decay'\?",
        None,
    ),
    "removed key": (
        lambda opt: opt.param_groups[0].pop("nesterov"),
        r"param group 0 \(muon\): 'nesterov' removed from the group since the optimizer was "
        r"built.*set it back",
        None,
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_edit_the_state_cannot_follow_is_refused_and_its_fix_works(name: str) -> None:
    """Refused by name at the next step, nothing changed and the step not counted, and
    by ``state_dict()`` while the edit stays; set back, the optimizer steps on, and the fix
    the message names works."""
    edit, message, fix = REFUSED[name]
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), **FP32)
    _step(model, opt, 0)
    groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    before = _params(model)
    edit(opt)
    with pytest.raises(ValueError, match=message):
        _step(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
    with pytest.raises(ValueError, match="state_dict\\(\\) refused: .*" + message):
        opt.state_dict()
    opt.param_groups[:] = [opt.param_groups[i] for i in range(len(groups))]
    for group, kept in zip(opt.param_groups, groups, strict=True):
        group.clear()
        group.update(kept)
    assert [g["steps"] for g in opt.param_groups] == [1, 1]
    if fix is not None:
        opt = fix(opt, model)
    _step(model, opt, 1)
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))


@pytest.mark.parametrize(("rule", "to"), [("muon", "normuon"), ("normuon", "muon")])
def test_a_rule_change_loads_the_old_state(rule: str, to: str) -> None:
    """A new optimizer under another rule, loaded with the old one's state, steps as a new
    optimizer under that rule would with the old momenta (NorMuon's row moments at zero)."""
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), rule=rule, **FP32)
    _step(model, opt, 0)
    twin = _model()
    twin.load_state_dict(model.state_dict())
    changed = muon_dist.Muon(model.named_parameters(), rule=to, **FP32)
    changed.load_state_dict(opt.state_dict())
    assert changed.param_groups[0]["rule"] == to
    fresh = muon_dist.Muon(twin.named_parameters(), rule=to, **FP32)
    fresh.load_state_dict(changed.state_dict())  # the converted state, under the same rule
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert fresh.state[q].keys() == changed.state[p].keys()
        if "row_second_moment" in changed.state[p]:
            assert not changed.state[p]["row_second_moment"].any()
    for seed in (1, 2):
        _step(model, changed, seed)
        _step(twin, fresh, seed)
    for a, b in zip(_params(model), _params(twin), strict=True):
        assert torch.equal(a, b)


def test_a_bad_value_of_an_option_read_when_built_is_refused_by_name() -> None:
    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), **FP32)
    _step(model, opt, 0)
    opt.param_groups[0]["ns_steps"] = 0
    with pytest.raises(ValueError, match=r"param group 0 \(muon\).*ns_steps"):
        _step(model, opt, 1)
