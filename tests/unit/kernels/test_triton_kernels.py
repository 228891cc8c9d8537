"""Triton Newton–Schulz kernels on CPU through Triton's interpreter, in fp32.

The interpreter's bf16 ``tl.dot`` is unreliable, so bf16 is checked on a GPU instead
(tests/gpu/test_gpu_kernels.py). conftest.py turns the interpreter on (TRITON_INTERPRET=1)
before Triton is imported, on machines without CUDA.
"""

import pytest
import torch

from muon_dist.kernels import newton_schulz, newton_schulz_torch
from muon_dist.kernels.availability import interpret_mode, triton_available
from muon_dist.kernels.coefficients import COEFFICIENT_SETS, Coefficients
from muon_dist.kernels.dispatch import prefer_triton
from muon_dist.kernels.triton_ns import newton_schulz_triton

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_kernels = pytest.importorskip("muon_dist.kernels.triton_kernels")
if not triton_kernels._INTERPRET:
    pytest.skip("Triton kernels were already built for the GPU", allow_module_level=True)
sym_product = triton_kernels.sym_product

TOL = 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def newton_schulz_float64(X: torch.Tensor, steps: int, coefficients: Coefficients) -> torch.Tensor:
    """The torch reference iteration run entirely in float64."""
    return newton_schulz_torch(X, steps=steps, coefficients=coefficients, dtype=torch.float64)


# (batch, m, k): sizes off the interpreter's 32-wide blocks, one with k a block multiple.
GRAM_SHAPES = [(1, 70, 50), (2, 33, 130), (3, 16, 16), (4, 1, 40), (5, 50, 70), (2, 36, 64)]


@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
def test_gram_matches_float64(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    P = torch.randn(shape)
    out = torch.full((shape[0], shape[1], shape[1]), float("nan"))
    sym_product(P, out=out)
    assert not out.isnan().any(), "a tile or its mirror was not written"
    assert rel_err(out, P.double() @ P.double().mT) < 1e-6


@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
def test_polynomial_matches_float64(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    batch, m, _ = shape
    A = torch.randn(batch, m, m)
    A = A + A.mT
    out = torch.full_like(A, float("nan"))
    sym_product(A, out=out, alpha=2.03, Y=A, beta=-4.78)
    ref = 2.03 * A.double() @ A.double() - 4.78 * A.double()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("shape", [(1, 70, 50), (3, 33, 130), (5, 16, 16)], ids=str)
def test_epilogue_scale_and_diagonal(shape: tuple[int, int, int]) -> None:
    """``scale·(alpha·P·Pᵀ + beta·Y + diag·I)`` with a different scale per matrix."""
    torch.manual_seed(3)
    batch, m, _ = shape
    P = torch.randn(shape)
    Y = torch.randn(batch, m, m)
    Y = Y + Y.mT
    scale = torch.rand(batch) + 0.5
    out = torch.full_like(Y, float("nan"))
    sym_product(P, out=out, alpha=1.7, Y=Y, beta=-0.3, diag=2.5, scale=scale)
    eye = torch.eye(m, dtype=torch.float64)
    ref = 1.7 * P.double() @ P.double().mT - 0.3 * Y.double() + 2.5 * eye
    ref = ref * scale.double().view(-1, 1, 1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-6


def test_epilogue_scale_is_checked() -> None:
    P = torch.randn(3, 8, 8)
    with pytest.raises(ValueError, match="3 float32 factors"):
        sym_product(P, out=torch.empty(3, 8, 8), scale=torch.ones(2))
    with pytest.raises(ValueError, match="3 float32 factors"):
        sym_product(P, out=torch.empty(3, 8, 8), scale=torch.ones(3, dtype=torch.float64))


def test_gram_reads_strided_input() -> None:
    """Strides are honoured: a transposed view gives the same Gram matrix."""
    torch.manual_seed(2)
    P = torch.randn(3, 45, 37).mT
    out = torch.empty(3, 37, 37)
    sym_product(P, out=out)
    assert rel_err(out, P.double() @ P.double().mT) < 1e-6


NS_SHAPES = [(70, 50), (33, 130), (2, 16, 16), (1, 40), (5, 20, 36), (4, 40, 1), (2, 2, 24, 40)]
# The interpreter takes seconds per iteration: the quick tier keeps one batched shape, and
# test_triton_kernels_slow.py runs the others.
QUICK_NS_SHAPE = (2, 16, 16)


def ns_cases(quick: bool) -> list[tuple[tuple[int, ...], str]]:
    return [
        (shape, coefficients)
        for shape in NS_SHAPES
        for coefficients in sorted(COEFFICIENT_SETS)
        if (shape == QUICK_NS_SHAPE) == quick
    ]


@pytest.mark.parametrize(("shape", "coefficients"), ns_cases(quick=True), ids=str)
def test_newton_schulz_matches_float64(shape: tuple[int, ...], coefficients: str) -> None:
    torch.manual_seed(3)
    X = torch.randn(shape)
    out = newton_schulz_triton(X, coefficients=coefficients, dtype=torch.float32)
    assert out.shape == X.shape and out.dtype == torch.float32 and out.is_contiguous()
    assert rel_err(out, newton_schulz_float64(X, 5, coefficients)) < TOL


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (2, 24, 40)], ids=str)
def test_input_is_left_unchanged(shape: tuple[int, ...]) -> None:
    X = torch.randn(shape)
    before = X.clone()
    newton_schulz_triton(X, steps=3, dtype=torch.float32)
    assert torch.equal(X, before)


def test_explicit_coefficients_and_steps() -> None:
    torch.manual_seed(4)
    X = torch.randn(3, 30, 45)
    triples = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    out = newton_schulz_triton(X, steps=3, coefficients=triples, dtype=torch.float32)
    assert rel_err(out, newton_schulz_float64(X, 3, triples)) < TOL


def test_matches_torch_reference_in_fp32() -> None:
    torch.manual_seed(5)
    X = torch.randn(2, 50, 30, dtype=torch.float64)
    out = newton_schulz_triton(X, dtype=torch.float32)
    ref = newton_schulz_torch(X, dtype=torch.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL


def test_zero_matrix_stays_zero() -> None:
    X = torch.randn(3, 20, 35)
    X[1] = 0
    out = newton_schulz_triton(X, dtype=torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    assert torch.equal(
        newton_schulz_triton(torch.zeros(40, 7), dtype=torch.float32), torch.zeros(40, 7)
    )


def test_dispatch_backends_on_cpu() -> None:
    torch.manual_seed(6)
    X = torch.randn(40, 24)
    ref = newton_schulz_torch(X, dtype=torch.float32)
    assert triton_available()
    assert torch.equal(newton_schulz(X, dtype=torch.float32, backend="auto"), ref)
    assert torch.equal(newton_schulz(X, dtype=torch.float32, backend="torch"), ref)
    out = newton_schulz(X, dtype=torch.float32, backend="triton")
    assert rel_err(out, ref) < TOL


def test_rejects_unsupported_input() -> None:
    with pytest.raises(TypeError, match="backend='torch'"):
        newton_schulz_triton(torch.randn(8, 8), dtype=torch.float64)
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz_triton(torch.randn(8))
    with pytest.raises(ValueError, match="ns_steps"):
        newton_schulz_triton(torch.randn(8, 8), steps=0)


def test_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        newton_schulz_triton(torch.randn(8, 8), dtype=torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend='torch'"):
            newton_schulz(torch.randn(8, 8), backend="triton")


def test_prefer_triton_rule() -> None:
    """Large single matrices and big expert stacks go to Triton; small work stays on torch."""
    assert prefer_triton(4096, 4096, 1)
    assert prefer_triton(14336, 4096, 1)
    assert prefer_triton(768, 2048, 32)
    assert not prefer_triton(1024, 4096, 1)
    assert not prefer_triton(256, 1024, 8)


def test_two_operand_product_is_exactly_symmetric() -> None:
    """``P·Qᵀ`` for commuting symmetric P and Q (polynomials of one matrix): every lower tile,
    diagonal tiles included, is mirrored, so the output is symmetric bit for bit."""
    torch.manual_seed(8)
    Z = torch.randn(2, 45, 60)
    R = Z @ Z.mT / 60
    P, Q = 2.0 * R - R @ R, torch.eye(45) + 0.5 * R
    out = torch.full_like(R, float("nan"))
    sym_product(P, Q=Q, out=out, alpha=1.5, scale=torch.tensor([1.0, 2.0]))
    assert torch.equal(out, out.mT)
    ref = 1.5 * P.double() @ Q.double() * torch.tensor([1.0, 2.0]).double().view(-1, 1, 1)
    assert rel_err(out, ref) < 1e-6
    with pytest.raises(ValueError, match="Q must have shape"):
        sym_product(P, Q=Q[:, :40], out=out)


GRAM_NS_SHAPES = [(24, 60), (60, 24), (2, 20, 50), (3, 36, 20), (1, 40)]
# As for ns_cases: the quick tier keeps one batched shape, the interpreter is slow.
QUICK_GRAM_NS_SHAPE = (2, 20, 50)


def gram_ns_cases(quick: bool) -> list[tuple[tuple[int, ...], str]]:
    return [
        (shape, coefficients)
        for shape in GRAM_NS_SHAPES
        for coefficients in sorted(COEFFICIENT_SETS)
        if (shape == QUICK_GRAM_NS_SHAPE) == quick
    ]


@pytest.mark.parametrize(("shape", "coefficients"), gram_ns_cases(quick=True), ids=str)
def test_gram_newton_schulz_matches_float64(shape: tuple[int, ...], coefficients: str) -> None:
    """fp32 Gram iteration on ill-conditioned input (singular values 1e-4..1) against a
    float64 standard iteration."""
    torch.manual_seed(9)
    m, n = shape[-2:]
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(*shape[:-2], m, k, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(*shape[:-2], n, k, dtype=torch.float64))
    X = (u * torch.logspace(0, -4, k, dtype=torch.float64)) @ v.mT
    out = newton_schulz(
        X.float(), coefficients=coefficients, dtype=torch.float32, backend="triton", method="gram"
    )
    assert out.shape == X.shape and out.dtype == torch.float32
    ref = newton_schulz_torch(X, coefficients=coefficients, dtype=torch.float64, eps=0.0)
    assert rel_err(out, ref) < TOL


def test_gram_newton_schulz_zero_and_rank_deficient() -> None:
    torch.manual_seed(10)
    X = torch.randn(3, 20, 44)
    X[1] = 0
    X[2] = torch.randn(20, 5) @ torch.randn(5, 44)
    out = newton_schulz(X, dtype=torch.float32, backend="triton", method="gram")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = newton_schulz_torch(X.double(), dtype=torch.float64)
    assert out.isfinite().all() and rel_err(out, ref) < TOL
