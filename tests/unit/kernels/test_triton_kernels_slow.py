"""The slow tier of test_triton_kernels.py: the other shapes, and Gram restarts, in Triton's
interpreter (seconds per iteration)."""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import TOL, gram_ns_cases, ns_cases, rel_err
from test_triton_kernels import test_gram_newton_schulz_matches_float64 as check_gram
from test_triton_kernels import test_newton_schulz_matches_float64 as check

from muon_dist.kernels import newton_schulz, newton_schulz_torch


@pytest.mark.parametrize(("shape", "coefficients"), ns_cases(quick=False), ids=str)
def test_newton_schulz_matches_float64(shape: tuple[int, ...], coefficients: str) -> None:
    check(shape, coefficients)


@pytest.mark.parametrize(("shape", "coefficients"), gram_ns_cases(quick=False), ids=str)
def test_gram_newton_schulz_matches_float64(shape: tuple[int, ...], coefficients: str) -> None:
    check_gram(shape, coefficients)


# Four interpreted iterations; test_gram_newton_schulz checks restart schedules quickly.
def test_gram_newton_schulz_restarts_and_input() -> None:
    torch.manual_seed(11)
    X = torch.randn(2, 24, 40)
    before = X.clone()
    ref = newton_schulz_torch(X.double(), steps=4, dtype=torch.float64)
    for restarts in [(), (1,), (2,), (1, 3)]:
        out = newton_schulz(
            X, steps=4, dtype=torch.float32, backend="triton", method="gram", gram_restarts=restarts
        )
        assert rel_err(out, ref) < TOL
    assert torch.equal(X, before)
