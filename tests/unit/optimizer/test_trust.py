"""Trust, one process: names, option types, state loads, storage changes, copies, autocast.

Each test reproduces a way a run went silently wrong or crashed after a partial update, and
asserts the error (naming the key, the value and the fix, with nothing changed) or the
correct result (equal to a fresh optimizer, or to the step without the disturbance).
"""

from __future__ import annotations

import copy
import io
import pickle
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import nn

import muon_dist

FP32 = {"comm_dtype": torch.float32, "ns_dtype": torch.float32}


def _tower(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))


def _grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _snapshot(opt: muon_dist.Muon) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {p: {k: v.detach().clone() for k, v in s.items()} for p, s in opt.state.items()}
    return copy.deepcopy(groups), state


def _assert_unchanged(opt: muon_dist.Muon, before: Any) -> None:
    groups, state = before
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert set(opt.state) == set(state)
    for p, entries in state.items():
        assert set(opt.state[p]) == set(entries)
        for key, value in entries.items():
            assert torch.equal(opt.state[p][key], value), key


# -- names (item 1) ---------------------------------------------------------------------


def test_colliding_param_names_are_refused_at_construction() -> None:
    a, b = _tower(0), _tower(1)
    with pytest.raises(ValueError, match=r"parameter name '0\.weight' is used twice .*prefix"):
        muon_dist.Muon(muon_dist.param_groups(a) + muon_dist.param_groups(b))
    opt = muon_dist.Muon(list(a.named_parameters()))
    with pytest.raises(ValueError, match=r"'1\.bias' is used twice"):
        opt.add_param_group(
            {"params": [b[1].bias], "param_names": ["1.bias"], "algorithm": "adamw"}
        )
    assert len(opt.param_groups) == 2


def test_saved_state_with_colliding_names_is_refused() -> None:
    model = _tower(0)
    opt = muon_dist.Muon(list(model.named_parameters()))
    _grads(list(model.parameters()), 0)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["param_names"] = ["0.weight", "0.weight"]  # an older version's
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"two parameters named '0\.weight'"):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, before)


def test_a_set_of_parameters_is_refused() -> None:
    model = _tower(0)
    with pytest.raises(TypeError, match=r"ordered collection, got a set"):
        muon_dist.Muon(set(model.parameters()))
    with pytest.raises(TypeError, match=r"got a set"):
        muon_dist.Muon([{"params": set(model.parameters())}])


# -- option types (items 7, 13) ---------------------------------------------------------


@pytest.mark.parametrize("value", ["1e-3", Decimal("0.001"), Fraction(1, 1000), True, None])
def test_adamw_options_must_be_real_numbers(value: object) -> None:
    model = _tower(0)
    with pytest.raises(TypeError, match=r"param group 1 \(adamw\): lr=.* pass a Python int"):
        muon_dist.Muon(model.parameters(), adamw_lr=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"param group 0 \(muon\): weight_decay=.* pass"):
        muon_dist.Muon(model.parameters(), weight_decay=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bucket_bytes", 1.5),
        ("bucket_bytes", True),
        ("max_inflight", 2.5),
        ("graph_warmup", 2.0),
        ("cuda_graph", 1),
    ],
)
def test_settings_must_have_their_types(key: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"{key}={value!r}"):
        muon_dist.Muon(_tower(0).parameters(), **{key: value})


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("momentum", 1.0, r"momentum=1\.0 is out of range"),
        ("momentum", float("nan"), r"momentum=nan is not finite"),
        ("lr", "0.1", r"lr='0\.1' is a str"),
        ("weight_decay", float("inf"), r"weight_decay=inf is not finite"),
        ("nesterov", 1, r"nesterov=1; choose True or False"),
    ],
)
def test_a_group_value_set_between_steps_is_refused_before_anything_changes(
    key: str, value: object, pattern: str
) -> None:
    model = _tower(0)
    params = list(model.parameters())
    opt = muon_dist.Muon(params)
    _grads(params, 0)
    opt.step()
    weights = [p.detach().clone() for p in params]
    opt.param_groups[0][key] = value
    before = _snapshot(opt)
    _grads(params, 1)
    with pytest.raises((ValueError, TypeError), match=rf"param group 0 \(muon\): {pattern}"):
        opt.step()
    _assert_unchanged(opt, before)  # the step count included
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights, strict=True))
    assert opt.param_groups[0]["steps"] == 1


def test_a_refused_step_is_not_counted() -> None:
    model = _tower(0)
    params = list(model.parameters())
    opt = muon_dist.Muon(params)
    _grads(params, 0)
    params[0].grad = params[0].grad.to_sparse()  # refused
    with pytest.raises(TypeError, match=r"sparse gradient"):
        opt.step()
    _grads(params, 0)
    params[1].grad[0] = float("nan")  # a non-finite gradient under "raise": refused
    with pytest.raises(FloatingPointError):
        opt.step()
    assert [g["steps"] for g in opt.param_groups] == [0, 0]
    _grads(params, 0)
    opt.step()
    assert [g["steps"] for g in opt.param_groups] == [1, 1]


# -- load_state_dict (item 8) -----------------------------------------------------------


def _trained() -> tuple[nn.Module, muon_dist.Muon]:
    model = _tower(0)
    opt = muon_dist.Muon(muon_dist.param_groups(model))
    _grads(list(model.parameters()), 0)
    opt.step()
    return model, opt


def _spoil(kind: str, saved: dict[str, Any]) -> None:
    muon, adamw = saved["param_groups"]
    if kind == "misspelled":
        muon["weight_decy"] = 0.1
    elif kind == "foreign":
        adamw["num_heads"] = 2
    elif kind == "string_lr":
        adamw["lr"] = "0.1"
    elif kind == "missing_group":
        del saved["param_groups"][1]
    elif kind == "missing_adamw_entry":
        del saved["state"][adamw["params"][0]]
    elif kind == "missing_momentum_entry":
        del saved["state"][muon["params"][0]]
    elif kind == "inf_momentum":
        saved["state"][muon["params"][0]]["momentum_buffer"][0, 0] = float("inf")
    elif kind == "nan_moment":
        saved["state"][adamw["params"][1]]["exp_avg_sq"][0] = float("nan")
    elif kind == "unknown_state_key":
        saved["state"][adamw["params"][0]]["exp_avg_sqr"] = torch.zeros(8)


LOAD_ERRORS = {
    "misspelled": r"unknown group key 'weight_decy'; did you mean 'weight_decay'",
    "foreign": r"num_heads=2 is a Muon option",
    "string_lr": r"lr='0\.1' is a str",
    "missing_group": r"absent from the saved state",
    "missing_adamw_entry": r"0\.bias: no state was saved for it",
    "missing_momentum_entry": r"0\.weight: no state was saved for it",
    "inf_momentum": r"0\.weight: saved momentum_buffer holds non-finite values",
    "nan_moment": r"1\.bias: saved exp_avg_sq holds non-finite values",
    "unknown_state_key": r"0\.bias: saved state has .*'exp_avg_sqr'",
}


@pytest.mark.parametrize("kind", list(LOAD_ERRORS))
def test_load_state_dict_refuses_a_bad_state_and_changes_nothing(kind: str) -> None:
    model, opt = _trained()
    saved = copy.deepcopy(opt.state_dict())
    _spoil(kind, saved)
    before = _snapshot(opt)
    with pytest.raises((ValueError, TypeError), match=LOAD_ERRORS[kind]):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, before)
    # The optimizer still steps its own tensors, as before the failed load.
    twin_model, twin = _trained()
    for m, o in ((model, opt), (twin_model, twin)):
        _grads(list(m.parameters()), 1)
        o.step()
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)


# -- saving and copying (items 9, 10) ---------------------------------------------------


def test_state_dict_round_trips_through_torch_save_exactly() -> None:
    model, opt = _trained()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    twin_model = _tower(0)
    twin_model.load_state_dict(model.state_dict())
    twin = muon_dist.Muon(muon_dist.param_groups(twin_model))
    twin.load_state_dict(loaded)
    for m, o in ((model, opt), (twin_model, twin)):
        _grads(list(m.parameters()), 1)
        o.step()
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_saved_momenta_are_copies() -> None:
    model, opt = _trained()
    saved = opt.state_dict()
    w = model[0].weight
    momentum = saved["state"][0]["momentum_buffer"]
    assert momentum.untyped_storage().data_ptr() != (
        opt.state[w]["momentum_buffer"].untyped_storage().data_ptr()
    )
    assert torch.equal(momentum, opt.state[w]["momentum_buffer"])


def test_copying_the_optimizer_is_refused_at_the_copy() -> None:
    _, opt = _trained()
    with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied.*load_state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match=r"cannot be pickled"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match=r"cannot be pickled"):
        torch.save(opt, io.BytesIO())


# -- parameters that changed storage (item 3) -------------------------------------------


def _fresh_twin(model: nn.Module, opt: muon_dist.Muon) -> tuple[nn.Module, muon_dist.Muon]:
    """A new model and optimizer with ``model``'s weights and ``opt``'s state."""
    twin = copy.deepcopy(model)
    twin_opt = muon_dist.Muon(muon_dist.param_groups(twin), **FP32)
    twin_opt.load_state_dict(opt.state_dict())
    return twin, twin_opt


@pytest.mark.parametrize("change", ["data", "bfloat16", "float64", "reassign"])
def test_a_parameter_with_new_storage_keeps_training(change: str) -> None:
    """The step follows the new storage (and dtype), exactly as a fresh optimizer would."""
    model = _tower(0)
    opt = muon_dist.Muon(muon_dist.param_groups(model), **FP32)
    _grads(list(model.parameters()), 0)
    opt.step()
    if change == "data":
        model[0].weight.data = model[0].weight.data.clone()
    elif change == "reassign":
        model[1].weight.data = torch.randn(4, 8)
    else:
        model.to(getattr(torch, change))
    twin, twin_opt = _fresh_twin(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    for m, o in ((model, opt), (twin, twin_opt)):
        _grads(list(m.parameters()), 1)
        o.step()
    for p, q, old in zip(model.parameters(), twin.parameters(), before, strict=True):
        assert p.dtype == q.dtype
        assert torch.equal(p, q)
        if p.ndim == 2:  # (a bf16 bias may not move under AdamW's lr 3e-4)
            assert not torch.equal(p.detach(), old), "the step left a matrix where it was"
    w = model[0].weight
    assert opt.state[w]["momentum_buffer"].dtype == w.dtype


# -- autocast (item 11) -----------------------------------------------------------------


def test_step_under_autocast_runs_in_the_configured_dtypes() -> None:
    results = []
    for autocast in (False, True):
        model = _tower(0)
        opt = muon_dist.Muon(muon_dist.param_groups(model), **FP32)
        _grads(list(model.parameters()), 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
