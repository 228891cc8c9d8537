"""Failure modes: non-finite and missing gradients, edge shapes, stale state, long runs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from dist_harness import run_distributed
from reliability_cases import CHECKS, reliability_worker
from torch import nn

import muon_dist


def _pair() -> tuple[nn.Parameter, nn.Parameter]:
    torch.manual_seed(0)
    return nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6))


def test_nonfinite_gradient_raises_with_names_and_step() -> None:
    w, b = _pair()
    opt = muon_dist.Muon(
        [
            {"params": [w], "param_names": ["attn.wq"], "algorithm": "muon"},
            {"params": [b], "param_names": ["norm.weight"], "algorithm": "adamw"},
        ]
    )
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    opt.step()
    b.grad[2] = float("inf")
    with pytest.raises(FloatingPointError, match=r"step 2: non-finite gradient in norm\.weight"):
        opt.step()


def test_skip_step_leaves_everything_untouched(caplog: pytest.LogCaptureFixture) -> None:
    w, b = _pair()
    opt = muon_dist.Muon([w, b], nonfinite="skip_step")
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    opt.step()
    before = (copy.deepcopy(opt.state_dict()["state"]), w.detach().clone(), b.detach().clone())
    w.grad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        opt.step()
    assert "skipped step 2" in caplog.text
    state = opt.state_dict()["state"]
    for key, value in before[0].items():
        for name, tensor in value.items():
            assert torch.equal(state[key][name], tensor), name
    assert torch.equal(w.detach(), before[1]) and torch.equal(b.detach(), before[2])
    assert [g["skipped_steps"] for g in opt.param_groups] == [1, 1]
    resumed = muon_dist.Muon([w, b], nonfinite="skip_step")
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["skipped_steps"] == 1


def test_zero_gradient_gives_zero_update() -> None:
    w = nn.Parameter(torch.randn(5, 7))
    opt = muon_dist.Muon([w], weight_decay=0.0)
    w.grad = torch.zeros(5, 7)
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w.detach(), before)


def test_no_gradient_leaves_parameter_and_state_alone() -> None:
    a, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    opt = muon_dist.Muon([a, b], weight_decay=0.1)
    a.grad = torch.randn(8, 8)
    b_before = b.detach().clone()
    opt.step()
    assert torch.equal(b.detach(), b_before)
    assert torch.count_nonzero(opt.state[b]["momentum_buffer"]) == 0


def test_frozen_parameters_are_not_routed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    names = [n for g in muon_dist.param_groups(model) for n in g["param_names"]]
    assert "0.weight" not in names and "1.weight" in names


def _named_model(hidden: int) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, hidden), nn.Linear(hidden, 3))


def test_load_state_dict_rejects_changed_routing() -> None:
    model = _named_model(6)
    opt = muon_dist.Muon(model.named_parameters())
    saved = opt.state_dict()
    # A shape changed: same routing, different tensors.
    other = muon_dist.Muon(_named_model(5).named_parameters())
    with pytest.raises(ValueError, match=r"0\.weight: saved momentum_buffer has shape \(6, 4\)"):
        other.load_state_dict(saved)
    # A parameter moved from Muon to AdamW.
    model = _named_model(6)
    moved = muon_dist.Muon(
        [
            {"params": [model[0].weight], "param_names": ["0.weight"], "algorithm": "adamw"},
            {"params": [model[1].weight], "param_names": ["1.weight"], "algorithm": "muon"},
            {
                "params": [model[0].bias, model[1].bias],
                "param_names": ["0.bias", "1.bias"],
                "algorithm": "adamw",
            },
        ]
    )
    with pytest.raises(ValueError, match=r"0\.weight: saved as muon, routed to adamw now"):
        moved.load_state_dict(saved)


@pytest.mark.parametrize("name", list(CHECKS))
def test_distributed_failure_mode(name: str) -> None:
    assert run_distributed(2, reliability_worker, name, timeout=180) == [name] * 2


def test_nonfinite_newton_schulz_result_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients are checked first, so a non-finite result means a fault or an overflow."""
    import muon_dist.step.bucket.orthogonalizer as optimizer_module

    def broken(stack: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.full_like(stack, float("nan"))

    monkeypatch.setattr(optimizer_module, "newton_schulz", broken)
    w = nn.Parameter(torch.randn(6, 4))
    opt = muon_dist.Muon([{"params": [w], "param_names": ["mlp.w2"], "algorithm": "muon"}])
    w.grad = torch.randn(6, 4)
    with pytest.raises(
        FloatingPointError, match=r"step 1: Newton–Schulz returned non-finite values for mlp\.w2"
    ):
        opt.step()


def test_nonfinite_newton_schulz_result_skips_under_skip_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import muon_dist.step.bucket.orthogonalizer as optimizer_module

    w, b = _pair()
    opt = muon_dist.Muon([w, b], nonfinite="skip_step", weight_decay=0.1)
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    opt.step()
    before = (copy.deepcopy(opt.state_dict()["state"]), w.detach().clone(), b.detach().clone())

    def broken(stack: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.full_like(stack, float("inf"))

    monkeypatch.setattr(optimizer_module, "newton_schulz", broken)
    opt.step()
    assert torch.equal(w.detach(), before[1]) and torch.equal(b.detach(), before[2])
    state = opt.state_dict()["state"]
    for key, value in before[0].items():
        for name, tensor in value.items():
            assert torch.equal(state[key][name], tensor), name
    assert opt.param_groups[0]["skipped_steps"] == 1


@pytest.mark.parametrize("options", [{}, {"magma": True}, {"cautious_wd": True}])
def test_skip_step_mode_updates_like_raise_mode(options: dict[str, object]) -> None:
    """The transactional path (compute, agree, then commit) gives the same training."""
    torch.manual_seed(3)
    fulls = [torch.randn(12, 8), torch.randn(3, 5, 4), torch.randn(7)]
    runs = []
    for policy in ("raise", "skip_step"):
        params = [nn.Parameter(f.clone()) for f in fulls]
        groups = [
            {"params": params[:1], "algorithm": "muon", "weight_decay": 0.1, **options},
            {"params": params[1:2], "algorithm": "muon", "experts": True, **options},
            {"params": params[2:], "algorithm": "adamw"},
        ]
        opt = muon_dist.Muon(groups, nonfinite=policy)
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append((params, opt.state_dict()["state"]))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    for key, value in runs[0][1].items():
        for name, tensor in value.items():
            torch.testing.assert_close(runs[1][1][key][name], tensor, rtol=0, atol=1e-6)
