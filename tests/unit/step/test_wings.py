"""A rule with a new kind of owner part is one rule file, one wing file and one registry
line: toy_halved_rule.py declares its wing, toy_halved_wing.py, and the fixture below
registers the rule; the step binds the wing and matches the rule's reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import toy_halved_rule
import toy_halved_wing

import muon_dist
from muon_dist.kernels import newton_schulz
from muon_dist.rules import registry
from muon_dist.rules.base import MatrixStep, Rule
from muon_dist.rules.scale import lr_scale
from muon_dist.step.wings.muon import MuonWing

LR, BETA = 0.02, 0.9


@pytest.fixture
def halved() -> Iterator[Rule]:
    rule = toy_halved_rule.Halved()
    registry.RULES[rule.name] = rule  # the one registry line
    try:
        yield rule
    finally:
        del registry.RULES[rule.name]


def _orthogonalize(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=5, coefficients="quintic", dtype=torch.float32, backend="torch")


@pytest.mark.parametrize("shape", [(10, 6), (6, 10)], ids=str)
def test_a_rule_with_a_new_owner_part_is_a_rule_file_a_wing_file_and_a_registry_line(
    halved: Rule, shape: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    weight = torch.nn.Parameter(start.clone())
    plain = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = muon_dist.Muon(
        [
            {"params": [weight], "algorithm": "muon", "rule": "halved"},
            {"params": [plain], "algorithm": "muon"},
        ],
        lr=LR,
        momentum=BETA,
        nesterov=False,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        backend="torch",
    )
    ref, ref_m = start.clone(), torch.zeros(shape)
    step = MatrixStep(LR, 0.0, BETA, False, lr_scale(*shape, "spectral_norm"))
    for grad in grads:
        weight.grad = grad.clone()
        plain.grad = torch.ones_like(plain)
        opt.step()
        toy_halved_rule.reference(ref, grad, ref_m, _orthogonalize, step)
    muon = opt.runner.muon
    assert muon is not None
    assert isinstance(muon.wings["halved"], toy_halved_wing.HalvedWing)
    assert type(muon.wings["muon"]) is MuonWing
    torch.testing.assert_close(opt.state[weight]["momentum_buffer"], ref_m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.detach(), ref, rtol=1e-5, atol=1e-6)
