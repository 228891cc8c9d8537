"""Dion2 on one process: the single-matrix rule against the independent reference, its
orientation, ``dion2_fraction=1`` against Muon, its options' checks, a changed fraction,
and a non-finite gradient.

The sharded step against the same reference is ``tests/distributed/rules/test_rule_parity.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composed_rules import dion2_update_
from reference_muon import reference_muon_step
from torch import nn

import muon_dist
from muon_dist.kernels import newton_schulz
from muon_dist.rules.scale import lr_scale

LR, WD, BETA = 0.02, 0.1, 0.9
FP32 = {"comm_dtype": torch.float32, "ns_dtype": torch.float32}


def _orthogonalize(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=5, dtype=torch.float32, backend="torch")


def _inputs(shape: tuple[int, int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(shape, generator=gen), [
        torch.randn(shape, generator=gen) for _ in range(steps)
    ]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(12, 30), (30, 12), (16, 16)], ids=str)
def test_rule_matches_the_independent_reference(shape: tuple[int, int], nesterov: bool) -> None:
    """Rows of a wide matrix, columns of a tall one, rows of a square one."""
    start, grads = _inputs(shape, 4)
    param, momentum = start.clone(), torch.zeros(shape)
    plain, plain_momentum = start.clone(), torch.zeros(shape)
    for step, grad in enumerate(grads):
        before = param.clone()
        dion2_update_(
            param,
            grad,
            momentum,
            _orthogonalize,
            lr=torch.tensor(LR),
            weight_decay=torch.tensor(WD),
            beta=BETA,
            nesterov=nesterov,
            scale=lr_scale(*shape, "spectral_norm"),
            keep=torch.tensor(True),
            fraction=0.25,
        )
        reference_muon_step(
            plain,
            grad,
            plain_momentum,
            lr=LR,
            momentum=BETA,
            nesterov=nesterov,
            weight_decay=WD,
            ns_dtype=torch.float32,
            dion2_fraction=0.25,
        )
        moved = (param - before * (1 - LR * WD)).abs().amax(1 if shape[0] <= shape[1] else 0)
        assert int((moved > 1e-4).sum()) == -(-min(shape) // 4), f"step {step}: slices moved"
    torch.testing.assert_close(momentum, plain_momentum, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(param, plain, rtol=1e-5, atol=1e-6)


def test_unkept_step_changes_nothing() -> None:
    start, (grad,) = _inputs((8, 12), 1)
    param, momentum = start.clone(), torch.randn(8, 12)
    before = momentum.clone()
    dion2_update_(
        param,
        grad * float("nan"),
        momentum,
        _orthogonalize,
        lr=torch.tensor(LR),
        weight_decay=torch.tensor(WD),
        beta=BETA,
        nesterov=True,
        scale=1.0,
        keep=torch.tensor(False),
        fraction=0.25,
    )
    assert torch.equal(param, start) and torch.equal(momentum, before)


def _train(rule: str, steps: int = 4, **options: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 6, bias=False))
    opt = muon_dist.Muon(model.parameters(), lr=LR, momentum=BETA, rule=rule, **FP32, **options)
    data = torch.randn(steps, 4, 8)
    for x in data:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("nesterov", [True, False])
def test_fraction_one_is_muon(nesterov: bool) -> None:
    """Every slice selected every step: Muon's update; the stored momentum rounds
    differently (``β·(M + G)`` against Muon's ``G + β·M``), so fp32 tolerance."""
    dion2 = _train("dion2", dion2_fraction=1.0, nesterov=nesterov)
    muon = _train("muon", nesterov=nesterov)
    for a, b in zip(dion2, muon, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_changed_fraction_rebuilds_the_step() -> None:
    """Half-way, the group's fraction changes: the rest of the run equals a run that
    used the new fraction from there on (the reference, per matrix)."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 8, bias=False)
    start = layer.weight.detach().clone()
    opt = muon_dist.Muon(layer.parameters(), lr=LR, momentum=BETA, rule="dion2", **FP32)
    plain, plain_momentum = start.clone(), torch.zeros_like(start)
    grads = [torch.randn(8, 12) for _ in range(4)]
    for i, grad in enumerate(grads):
        fraction = 0.25 if i < 2 else 0.5
        opt.param_groups[0]["dion2_fraction"] = fraction
        layer.weight.grad = grad.clone()
        opt.step()
        reference_muon_step(
            plain,
            grad,
            plain_momentum,
            lr=LR,
            momentum=BETA,
            weight_decay=opt.param_groups[0]["weight_decay"],
            ns_dtype=torch.float32,
            dion2_fraction=fraction,
        )
    torch.testing.assert_close(layer.weight.detach(), plain, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_gradient_changes_nothing() -> None:
    model = nn.Linear(12, 8, bias=False)
    opt = muon_dist.Muon(model.parameters(), rule="dion2", nonfinite="skip_step", **FP32)
    model.weight.grad = torch.randn(8, 12)
    opt.step()
    before = (model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone())
    model.weight.grad = torch.full((8, 12), float("nan"))
    opt.step()
    assert torch.equal(model.weight.detach(), before[0])
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], before[1])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rule": "dion2", "dion2_fraction": 0.0}, r"dion2_fraction=0.0 is out of range"),
        ({"rule": "dion2", "dion2_fraction": 1.5}, r"dion2_fraction=1.5 is out of range"),
        ({"rule": "dion2", "dion2_fraction": float("nan")}, r"dion2_fraction=nan"),
        ({"rule": "dion2", "magma": True}, r"magma=True with rule='dion2'"),
        ({"rule": "dion2", "cautious_wd": True}, r"cautious_wd=True with rule='dion2'"),
    ],
)
def test_bad_options_raise(options: dict[str, Any], match: str) -> None:
    model = nn.Linear(8, 6, bias=False)
    with pytest.raises(ValueError, match=match):
        muon_dist.Muon(model.parameters(), **options)


def test_a_string_fraction_raises() -> None:
    model = nn.Linear(8, 6, bias=False)
    with pytest.raises(TypeError, match="dion2_fraction"):
        muon_dist.Muon(model.parameters(), rule="dion2", dion2_fraction="x")


def test_the_step_and_its_graph_cache_are_freed_with_the_optimizer() -> None:
    """Nothing outside the optimizer keeps its step: the graphs its Newton–Schulz replays
    on CUDA (and their memory) go with it."""
    import gc
    import weakref

    layer = nn.Linear(12, 8, bias=False)
    opt = muon_dist.Muon(layer.parameters(), rule="dion2", **FP32)
    layer.weight.grad = torch.randn(8, 12)
    opt.step()
    muon = opt.runner.muon
    assert muon is not None
    graphs = weakref.ref(muon.orthogonalizer.graphs)
    del opt, muon
    gc.collect()
    assert graphs() is None
