"""NorMuon on one process: the single-matrix rule against the independent reference, its
orientation, its options' checks and its state through ``state_dict``.

The sharded step against the same reference is ``tests/distributed/rules/test_rule_parity.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from composed_rules import normuon_update_
from reference_muon import reference_muon_step
from torch import nn

import muon_dist
from muon_dist.kernels import newton_schulz
from muon_dist.rules.scale import lr_scale

LR, WD, BETA, BETA2, EPS = 0.02, 0.1, 0.9, 0.95, 1e-8


def _orthogonalize(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=5, dtype=torch.float32, backend="torch")


def _step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    moment: torch.Tensor,
    keep: bool = True,
    transposed: bool = False,
) -> None:
    out_dim, in_dim = param.shape[::-1] if transposed else param.shape
    normuon_update_(
        param,
        grad,
        momentum,
        moment,
        _orthogonalize,
        lr=torch.tensor(LR),
        weight_decay=torch.tensor(WD),
        beta=BETA,
        nesterov=True,
        scale=lr_scale(out_dim, in_dim, "spectral_norm"),
        keep=torch.tensor(keep),
        beta2=BETA2,
        eps=EPS,
        transposed=transposed,
    )


def _inputs(shape: tuple[int, int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(shape, generator=gen), [
        torch.randn(shape, generator=gen) for _ in range(steps)
    ]


@pytest.mark.parametrize("shape", [(12, 8), (6, 20)])
def test_rule_matches_the_independent_reference(shape: tuple[int, int]) -> None:
    """Three steps of ``normuon_update_`` against ``tests/support/reference_muon.py``."""
    start, grads = _inputs(shape, 3)
    got, got_m, got_v = start.clone(), torch.zeros(shape), torch.zeros(shape[0])
    ref, ref_m, ref_v = start.clone(), torch.zeros(shape), torch.zeros(shape[0])
    for grad in grads:
        _step(got, grad, got_m, got_v)
        reference_muon_step(
            ref,
            grad,
            ref_m,
            lr=LR,
            momentum=BETA,
            weight_decay=WD,
            ns_dtype=torch.float32,
            row_moment=ref_v,
            normuon_beta2=BETA2,
            normuon_eps=EPS,
        )
    torch.testing.assert_close(got_v, ref_v, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # Rows are normalized: their second moments differ, so the update is not Muon's.
    assert got_v.std() > 0


def test_unkept_step_changes_nothing() -> None:
    start, (grad,) = _inputs((12, 8), 1)
    param, momentum, moment = start.clone(), torch.ones(12, 8), torch.full((12,), 0.5)
    _step(param, grad, momentum, moment, keep=False)
    assert torch.equal(param, start)
    assert torch.equal(momentum, torch.ones(12, 8))
    assert torch.equal(moment, torch.full((12,), 0.5))


def test_in_out_storage_normalizes_columns() -> None:
    """A matrix stored ``[in, out]`` (``transposed``) takes the step of its ``[out, in]``
    transpose: the statistics follow the output neurons, not the storage."""
    start, grads = _inputs((12, 8), 2)
    stored, stored_m, stored_v = start.T.clone(), torch.zeros(8, 12), torch.zeros(12)
    plain, plain_m, plain_v = start.clone(), torch.zeros(12, 8), torch.zeros(12)
    for grad in grads:
        _step(stored, grad.T.contiguous(), stored_m, stored_v, transposed=True)
        _step(plain, grad, plain_m, plain_v)
    torch.testing.assert_close(stored_v, plain_v, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stored.T, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"rule": "dion"}, ValueError, "rule='dion' is not supported"),
        ({"rule": "normuon", "normuon_beta2": 1.0}, ValueError, "normuon_beta2=1.0"),
        ({"rule": "normuon", "normuon_eps": 0.0}, ValueError, "normuon_eps=0.0 must be > 0"),
        ({"rule": "normuon", "normuon_eps": float("nan")}, ValueError, "normuon_eps=nan"),
    ],
)
def test_bad_options_raise(options: dict[str, Any], error: type[Exception], match: str) -> None:
    model = nn.Linear(8, 6, bias=False)
    with pytest.raises(error, match=match):
        muon_dist.Muon(model.parameters(), **options)


def _trained(dtype: torch.dtype, rule: str) -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 6, bias=False)).to(dtype)
    opt = muon_dist.Muon(model.parameters(), rule=rule)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8, dtype=dtype)).float().square().mean().backward()
        opt.step()
    return model, opt


def test_moments_stay_fp32_through_state_dict_for_bf16_parameters() -> None:
    model, opt = _trained(torch.bfloat16, "normuon")
    state = opt.state_dict()
    resumed, resumed_opt = _trained(torch.bfloat16, "normuon")
    resumed_opt.load_state_dict(state)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        saved, loaded = opt.state[a]["row_second_moment"], resumed_opt.state[b]
        assert loaded["row_second_moment"].dtype == torch.float32
        assert torch.equal(loaded["row_second_moment"], saved)
        assert loaded["row_second_moment"].shape == (a.shape[0],)


def test_a_state_saved_under_the_other_rule_loads_under_this_one_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rule is the optimizer's: NorMuon's row moments are dropped, loudly (a rule
    change is building the new optimizer and loading the old state; test_group_edits.py)."""
    model, muon_opt = _trained(torch.float32, "muon")
    _, normuon_opt = _trained(torch.float32, "normuon")
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_opt.load_state_dict(normuon_opt.state_dict())
    assert "saved with rule='normuon' and is loaded as this optimizer's rule='muon'" in caplog.text
    assert muon_opt.param_groups[0]["rule"] == "muon"
    assert all(set(muon_opt.state[p]) == {"momentum_buffer"} for p in model.parameters())


def test_a_changed_beta2_is_read_at_the_next_step() -> None:
    """A group's ``normuon_beta2`` changed between steps (as a scheduler would) takes effect,
    exactly as the single-matrix rule with the new value."""
    start, grads = _inputs((12, 8), 2)
    weight = nn.Parameter(start.clone())
    opt = muon_dist.Muon(
        [{"params": [weight], "lr": LR, "momentum": BETA, "weight_decay": WD}],
        rule="normuon",
        normuon_beta2=BETA2,
        ns_dtype=torch.float32,
        comm_dtype=torch.float32,
    )
    ref, ref_m, ref_v = start.clone(), torch.zeros(12, 8), torch.zeros(12)
    for beta2, grad in zip((BETA2, 0.5), grads, strict=True):
        opt.param_groups[0]["normuon_beta2"] = beta2
        weight.grad = grad.clone()
        opt.step()
        reference_muon_step(
            ref,
            grad,
            ref_m,
            lr=LR,
            momentum=BETA,
            weight_decay=WD,
            ns_dtype=torch.float32,
            row_moment=ref_v,
            normuon_beta2=beta2,
            normuon_eps=EPS,
        )
    torch.testing.assert_close(opt.state[weight]["row_second_moment"], ref_v, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(weight.detach(), ref, rtol=1e-5, atol=1e-6)
