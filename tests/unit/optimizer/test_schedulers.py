"""torch's learning-rate schedulers drive both kinds of group with their default arguments."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

import muon_dist

Scheduler = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]

SCHEDULERS: dict[str, Scheduler] = {
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 1e-3], total_steps=10),
    "CyclicLR": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=1e-4, max_lr=0.05, step_size_up=2),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, 2),
    "PolynomialLR": lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=4),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_defaults_are_the_constructor_arguments() -> None:
    opt = muon_dist.Muon(_model().parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    assert opt.defaults == {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    adamw = next(g for g in opt.param_groups if g["algorithm"] == "adamw")
    assert "momentum" not in adamw and adamw["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_drives_muon_and_adamw_groups(name: str) -> None:
    model = _model()
    opt = muon_dist.Muon(muon_dist.param_groups(model), lr=0.02, adamw_lr=3e-4)
    scheduler = SCHEDULERS[name](opt)
    seen: dict[str, set[float]] = {"muon": set(), "adamw": set()}
    for _ in range(4):
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        for group in opt.param_groups:
            seen[group["algorithm"]].add(group["lr"])
    assert len(seen["muon"]) > 1 and len(seen["adamw"]) > 1, seen
    momenta = {g["momentum"] for g in opt.param_groups if g["algorithm"] == "muon"}
    if name in ("OneCycleLR", "CyclicLR"):
        assert momenta != {0.95}  # cycled from the default momentum
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_reduce_on_plateau_lowers_both_kinds() -> None:
    model = _model()
    opt = muon_dist.Muon(muon_dist.param_groups(model))
    scheduler = lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    before = [g["lr"] for g in opt.param_groups]
    for _ in range(3):
        scheduler.step(1.0)
    assert all(g["lr"] < b for g, b in zip(opt.param_groups, before, strict=True))


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_a_changed_momentum_is_used_by_the_next_step(nonfinite: str) -> None:
    """Schedulers that cycle ``momentum`` (OneCycleLR, CyclicLR) change it between steps:
    every step must use the group's current value, as single-device Muon does."""
    from reference_muon import reference_muon_step

    gen = torch.Generator().manual_seed(3)
    full = torch.randn(12, 8, generator=gen)
    param = nn.Parameter(full.clone())
    opt = muon_dist.Muon(
        [{"params": [param], "algorithm": "muon"}],
        lr=0.02,
        nonfinite=nonfinite,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
    )
    ref, buffer = full.clone(), torch.zeros_like(full)
    for beta in (0.95, 0.8, 0.6, 0.9):
        opt.param_groups[0]["momentum"] = beta
        grad = torch.randn(full.shape, generator=gen)
        param.grad = grad.clone()
        opt.step()
        reference_muon_step(ref, grad, buffer, lr=0.02, momentum=beta, ns_dtype=torch.float32)
        torch.testing.assert_close(param.detach(), ref, rtol=0, atol=1e-6)
