"""Gram Newton–Schulz (torch): the standard iteration's result from the short side's Gram matrix."""

from __future__ import annotations

import math

import pytest
import torch

from muon_dist.kernels import newton_schulz, newton_schulz_torch
from muon_dist.kernels.coefficients import COEFFICIENT_SETS
from muon_dist.kernels.dispatch import prefer_gram
from muon_dist.kernels.gram import (
    DEFAULT_RESTARTS,
    newton_schulz_gram_torch,
    segments,
    validate_restarts,
    wide_gram,
)

TOL = 1e-4


def conditioned(
    rows: int, cols: int, smallest: float, seed: int, rank: int | None = None, batch: int = 1
) -> torch.Tensor:
    """A [batch, rows, cols] stack with singular values log-spaced from 1 down to ``smallest``,
    the ones past ``rank`` set to zero."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(batch, rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(batch, cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, math.log10(smallest), k, dtype=torch.float64)
    if rank is not None:
        s[rank:] = 0
    return (u * s) @ v.mT


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def float64_standard(X: torch.Tensor, coefficients: str = "quintic") -> torch.Tensor:
    return newton_schulz_torch(X, coefficients=coefficients, dtype=torch.float64, eps=0.0)


@pytest.mark.parametrize("coefficients", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("aspect", [1.5, 2, 4, 8])
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize(
    ("smallest", "rank"), [(1e-4, None), (1e-4, 9)], ids=["ill_conditioned", "rank_deficient"]
)
def test_fp32_gram_matches_float64_standard(
    coefficients: str, aspect: float, tall: bool, smallest: float, rank: int | None
) -> None:
    m = 24
    X = conditioned(m, int(aspect * m), smallest, seed=int(10 * aspect), rank=rank, batch=2)
    if tall:
        X = X.mT
    out = newton_schulz(X.float(), coefficients=coefficients, dtype=torch.float32, method="gram")
    assert out.shape == X.shape and out.dtype == torch.float32
    assert rel_err(out, float64_standard(X, coefficients)) < TOL


def test_zero_matrices_stay_zero() -> None:
    X = torch.randn(3, 16, 48)
    X[1] = 0
    out = newton_schulz_gram_torch(X, dtype=torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[0], float64_standard(X[0].double())) < TOL
    for shape in [(8, 20), (20, 8)]:
        zeros = torch.zeros(shape)
        assert torch.equal(newton_schulz(zeros, method="gram"), zeros.bfloat16())


def test_bf16_rank_deficient_is_finite_and_in_band() -> None:
    """bf16 with the fp16 working state: no NaN, singular values where the standard path's are."""
    X = conditioned(48, 192, 1e-4, seed=3, rank=16)[0].float()
    gram = newton_schulz(X, method="gram").double()
    standard = newton_schulz(X, method="standard").double()
    assert gram.isfinite().all()
    top = torch.linalg.svdvals(gram)[:16]
    band = torch.linalg.svdvals(standard)[:16]
    assert band.min() - 0.05 <= top.min() and top.max() <= band.max() + 0.05


@pytest.mark.parametrize("restarts", [(), (1,), (2,), (1, 3), (2, 4), (3,), (9,)])
def test_every_restart_schedule_is_the_same_iteration(restarts: tuple[int, ...]) -> None:
    """Restarts change rounding only: in float64 every schedule gives the standard result."""
    X = conditioned(20, 50, 1e-2, seed=5, batch=2)
    out = newton_schulz_gram_torch(X, dtype=torch.float64, restarts=restarts, eps=0.0)
    assert rel_err(out, float64_standard(X)) < 1e-10


def test_leading_dims_and_batches() -> None:
    X = torch.randn(2, 3, 20, 44)
    batched = newton_schulz(X, dtype=torch.float32, method="gram")
    assert batched.shape == X.shape
    for i in range(2):
        for j in range(3):
            single = newton_schulz(X[i, j], dtype=torch.float32, method="gram")
            torch.testing.assert_close(batched[i, j], single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (2, 24, 40)])
def test_input_is_left_unchanged(shape: tuple[int, ...]) -> None:
    X = torch.randn(shape)
    before = X.clone()
    newton_schulz(X, dtype=torch.float32, method="gram")
    assert torch.equal(X, before)


def test_explicit_coefficients_and_steps() -> None:
    X = conditioned(16, 40, 1e-3, seed=7)
    triples = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    for steps in (1, 3, 7):
        out = newton_schulz(
            X.float(), steps=steps, coefficients=triples, dtype=torch.float32, method="gram"
        )
        ref = newton_schulz_torch(X, steps=steps, coefficients=triples, dtype=torch.float64)
        assert rel_err(out, ref) < TOL


def test_auto_is_standard_off_cuda() -> None:
    """The Gram iteration was measured faster only on CUDA; elsewhere auto stays standard."""
    X = torch.randn(16, 64)
    assert torch.equal(newton_schulz(X, method="auto"), newton_schulz_torch(X))


def test_prefer_gram_rule() -> None:
    assert prefer_gram(4096, 14336) and prefer_gram(14336, 4096)
    assert prefer_gram(1536, 4096)
    assert not prefer_gram(4096, 4096)
    assert not prefer_gram(4096, 6144)


def test_segments_split_at_restarts() -> None:
    assert segments(5, (3,)) == [range(0, 3), range(3, 5)]
    assert segments(5, (1, 3)) == [range(0, 1), range(1, 3), range(3, 5)]
    assert segments(2, (3,)) == [range(0, 2)]
    assert segments(4, ()) == [range(0, 4)]
    assert all(k >= 1 for k in DEFAULT_RESTARTS)


@pytest.mark.parametrize("restarts", [(0,), (-1,), (1.5,), ("2",), (True,), 3])
def test_bad_restarts_raise(restarts: object) -> None:
    with pytest.raises(ValueError, match="gram_restarts"):
        validate_restarts(restarts)  # type: ignore[arg-type]


def test_bad_method_raises() -> None:
    with pytest.raises(ValueError, match="method='fast'"):
        newton_schulz(torch.randn(4, 8), method="fast")


def test_wide_gram_accumulates_in_fp32() -> None:
    Z = torch.randn(2, 8, 300).bfloat16()
    R = wide_gram(Z)
    assert R.dtype == torch.float32
    exact = Z.double() @ Z.double().mT
    assert rel_err(R, exact) < 1e-6
