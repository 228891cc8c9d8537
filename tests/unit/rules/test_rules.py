"""Each rule's plain-torch reference against the step's own batched ops composed for one
matrix (``composed_rules.py``), and a toy rule added in one file and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from composed_rules import dion2_update_, muon_update_, normuon_update_

import muon_dist
from muon_dist.kernels import newton_schulz
from muon_dist.rules import dion2, muon, normuon, registry
from muon_dist.rules.base import MatrixStep, Rule, RulePart, ViewShape
from muon_dist.rules.scale import lr_scale

LR, WD, BETA = 0.02, 0.1, 0.9
STEPS = 3
CLOSE = {"rtol": 2e-5, "atol": 1e-6}


def _orthogonalize(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=5, dtype=torch.float32, backend="torch")


def _inputs(shape: tuple[int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(shape, generator=gen), [
        torch.randn(shape, generator=gen) for _ in range(STEPS)
    ]


def _scale(shape: tuple[int, int], transposed: bool) -> float:
    out_dim, in_dim = shape[::-1] if transposed else shape
    return lr_scale(out_dim, in_dim, "spectral_norm")


def _device_scalars() -> dict[str, torch.Tensor]:
    return {"lr": torch.tensor(LR), "weight_decay": torch.tensor(WD), "keep": torch.tensor(True)}


def _matrix_step(shape: tuple[int, int], transposed: bool, nesterov: bool) -> MatrixStep:
    return MatrixStep(LR, WD, BETA, nesterov, _scale(shape, transposed))


@pytest.mark.parametrize("shape", [(12, 8), (6, 20)], ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("options", [{}, {"cautious": True}, {"magma": True}], ids=str)
def test_muon_reference_matches_the_composed_ops(
    shape: tuple[int, int], nesterov: bool, options: dict[str, Any]
) -> None:
    start, grads = _inputs(shape)
    ref, got = start.clone(), start.clone()
    ref_m, got_m = torch.zeros(shape), torch.zeros(shape)
    magma = options.get("magma", False)
    ref_s, got_s = torch.ones(1), torch.ones(1)
    common = {"beta": BETA, "nesterov": nesterov, "scale": _scale(shape, False)}
    cautious = options.get("cautious", False)
    step = _matrix_step(shape, False, nesterov)
    for grad in grads:
        score = ref_s if magma else None
        muon.reference(ref, grad, ref_m, _orthogonalize, step, cautious=cautious, magma_score=score)
        muon_update_(
            got,
            grad,
            got_m,
            _orthogonalize,
            cautious=cautious,
            magma_score=got_s if magma else None,
            **_device_scalars(),
            **common,
        )
    torch.testing.assert_close(got_m, ref_m, **CLOSE)
    torch.testing.assert_close(got, ref, **CLOSE)
    torch.testing.assert_close(got_s, ref_s, **CLOSE)


@pytest.mark.parametrize("shape", [(12, 8), (6, 20)], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
def test_normuon_reference_matches_the_composed_ops(
    shape: tuple[int, int], transposed: bool
) -> None:
    start, grads = _inputs(shape)
    ref, got = start.clone(), start.clone()
    ref_m, got_m = torch.zeros(shape), torch.zeros(shape)
    rows = shape[1] if transposed else shape[0]
    ref_v, got_v = torch.zeros(rows), torch.zeros(rows)
    own = {"beta2": 0.95, "eps": 1e-8, "transposed": transposed}
    common = {"beta": BETA, "nesterov": True, "scale": _scale(shape, transposed), **own}
    step = _matrix_step(shape, transposed, True)
    for grad in grads:
        normuon.reference(ref, grad, ref_m, ref_v, _orthogonalize, step, **own)
        normuon_update_(got, grad, got_m, got_v, _orthogonalize, **_device_scalars(), **common)
    torch.testing.assert_close(got_v, ref_v, **CLOSE)
    torch.testing.assert_close(got, ref, **CLOSE)


@pytest.mark.parametrize("shape", [(12, 8), (6, 20), (7, 7)], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_dion2_reference_matches_the_composed_ops(
    shape: tuple[int, int], transposed: bool, fraction: float
) -> None:
    start, grads = _inputs(shape)
    ref, got = start.clone(), start.clone()
    ref_m, got_m = torch.zeros(shape), torch.zeros(shape)
    own = {"fraction": fraction, "transposed": transposed}
    common = {"beta": BETA, "nesterov": False, "scale": _scale(shape, transposed), **own}
    step = _matrix_step(shape, transposed, False)
    for grad in grads:
        dion2.reference(ref, grad, ref_m, _orthogonalize, step, **own)
        dion2_update_(got, grad, got_m, _orthogonalize, **_device_scalars(), **common)
    torch.testing.assert_close(got_m, ref_m, **CLOSE)
    torch.testing.assert_close(got, ref, **CLOSE)


# -- a new rule: one file (this class and its reference) and one registry line ------------


def accumulate_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    *,
    lr: float,
    beta: float,
    scale: float,
) -> None:
    """A toy rule: the momentum sums the gradients undecayed; Nesterov's input as Muon's."""
    momentum.add_(grad)
    param.sub_(orthogonalize(grad.add(momentum, alpha=beta)), alpha=lr * scale)


class Accumulate(Rule):
    """The toy rule: Muon's step with a momentum that never decays."""

    name = "accumulate"

    def momentum_carry(self, group: dict[str, Any]) -> float:
        return 1.0


@pytest.fixture
def accumulate() -> Iterator[Rule]:
    rule = Accumulate()
    registry.RULES[rule.name] = rule  # the one registry line
    try:
        yield rule
    finally:
        del registry.RULES[rule.name]


def test_a_new_rule_is_one_class_and_one_registry_line(accumulate: Rule) -> None:
    shape = (10, 6)
    start, grads = _inputs(shape)
    weight = torch.nn.Parameter(start.clone())
    opt = muon_dist.Muon(
        [{"params": [weight], "algorithm": "muon"}],
        lr=LR,
        momentum=BETA,
        rule="accumulate",
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        backend="torch",
    )
    ref, ref_m = start.clone(), torch.zeros(shape)
    for grad in grads:
        weight.grad = grad.clone()
        opt.step()
        accumulate_reference(
            ref, grad, ref_m, _orthogonalize, lr=LR, beta=BETA, scale=_scale(shape, False)
        )
    torch.testing.assert_close(opt.state[weight]["momentum_buffer"], ref_m, rtol=0, atol=0)
    torch.testing.assert_close(weight.detach(), ref, **CLOSE)


class NorAccumulate(Rule):
    """A toy rule with an owner part: the undecayed momentum of :class:`Accumulate`, and
    NorMuon's row normalization on the owner (its step part, made by
    NorMuon's wing, which it declares)."""

    name = "noraccumulate"
    wing = normuon.NorMuon.wing
    fp32_state = (normuon.ROW_MOMENT,)

    def state_shapes(self, views: Sequence[ViewShape]) -> dict[str, tuple[int, ...]]:
        return {normuon.ROW_MOMENT: (normuon.row_count(views),)}

    def momentum_carry(self, group: dict[str, Any]) -> float:
        return 1.0

    def stack_part(self, group: dict[str, Any], transposed: bool) -> RulePart:
        return RulePart(self.name, transposed)


@pytest.fixture
def noraccumulate() -> Iterator[Rule]:
    rule = NorAccumulate()
    registry.RULES[rule.name] = rule  # the one registry line
    try:
        yield rule
    finally:
        del registry.RULES[rule.name]


@pytest.mark.parametrize("shape", [(10, 6), (6, 10)], ids=str)
def test_a_new_rule_with_an_owner_part_is_one_class_and_one_registry_line(
    noraccumulate: Rule, shape: tuple[int, int]
) -> None:
    start, grads = _inputs(shape)
    weight = torch.nn.Parameter(start.clone())
    opt = muon_dist.Muon(
        [{"params": [weight], "algorithm": "muon"}],
        lr=LR,
        momentum=BETA,
        rule="noraccumulate",
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        backend="torch",
    )
    group = opt.param_groups[0]
    ref, ref_m, ref_v = start.clone(), torch.zeros(shape), torch.zeros(shape[0])
    # NorMuon's reference with a carry of 1 (β = 1, no Nesterov), its Newton–Schulz reading
    # the toy's Nesterov input g + β·m from the advanced momentum m.
    step = MatrixStep(LR, 0.0, 1.0, False, _scale(shape, False))
    for grad in grads:
        weight.grad = grad.clone()
        opt.step()
        normuon.reference(
            ref,
            grad,
            ref_m,
            ref_v,
            lambda m, g=grad: _orthogonalize(g.add(m, alpha=BETA)),
            step,
            beta2=group["normuon_beta2"],
            eps=group["normuon_eps"],
        )
    torch.testing.assert_close(opt.state[weight]["momentum_buffer"], ref_m, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[weight][normuon.ROW_MOMENT], ref_v, **CLOSE)
    torch.testing.assert_close(weight.detach(), ref, **CLOSE)


def test_an_unknown_rule_names_the_registered_ones() -> None:
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"rule='nope' is not supported.*'dion2'"):
        muon_dist.Muon([{"params": [weight], "algorithm": "muon"}], rule="nope")
