"""Newton–Schulz reference: polar-factor quality per coefficient set, batching, zeros."""

from __future__ import annotations

import pytest
import torch

from muon_dist.kernels import newton_schulz, resolve_coefficients
from muon_dist.kernels.torch_ns import gram_inverse_norms, inverse_norms, scale_matrices_

# Singular values each set leaves on inputs spanning two decades (condition number 100),
# after 5 steps in bf16. Keller's quintic overshoots 1 by design, trading accuracy for
# faster growth of small singular values; the schedules converge tighter.
DESIGNED_BANDS = {
    "keller": (0.65, 1.25),
    "quintic": (0.9, 1.2),
    "polar_express": (0.8, 1.2),
}


def conditioned(rows: int, cols: int, cond: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return u @ torch.diag(s) @ v.T


@pytest.mark.parametrize("name", sorted(DESIGNED_BANDS))
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96), (17, 300)])
def test_singular_values_land_in_designed_band(name: str, shape: tuple[int, int]) -> None:
    x = conditioned(*shape, cond=100.0, seed=shape[0])
    out = newton_schulz(x, coefficients=name).double()
    s = torch.linalg.svdvals(out)
    low, high = DESIGNED_BANDS[name]
    assert low <= s.min().item() and s.max().item() <= high, (name, s.min(), s.max())
    # The output's singular vectors are those of the input: it approximates U V^T.
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    polar = u @ vh
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    assert cosine > 0.98


def test_batched_equals_loop_over_matrices() -> None:
    x = torch.randn(2, 3, 40, 24)
    batched = newton_schulz(x, dtype=torch.float32)
    for i in range(2):
        for j in range(3):
            single = newton_schulz(x[i, j], dtype=torch.float32)
            torch.testing.assert_close(batched[i, j], single, rtol=1e-5, atol=1e-6)


def test_zero_input_gives_zeros() -> None:
    for shape in [(8, 5), (3, 8, 5), (5, 8)]:
        out = newton_schulz(torch.zeros(shape))
        assert torch.equal(out, torch.zeros(shape, dtype=torch.bfloat16))


def test_tall_equals_transposed_wide() -> None:
    """Tall matrices take the Gram matrix on the right instead of a transpose: same result."""
    x = torch.randn(3, 70, 40, dtype=torch.float64)
    tall = newton_schulz(x, dtype=torch.float64)
    wide = newton_schulz(x.mT, dtype=torch.float64)
    torch.testing.assert_close(tall, wide.mT, rtol=1e-12, atol=1e-12)


def test_folded_normalisation_matches_dividing_first() -> None:
    """The first step works on X/‖X‖ without dividing X: equal to dividing, then iterating."""
    x = 1e3 * torch.randn(2, 24, 56, dtype=torch.float64)
    schedule = resolve_coefficients("polar_express", 5)
    y = x / (schedule.norm_scale * torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))
    for a, b, c in schedule.steps:
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    out = newton_schulz(x, coefficients="polar_express", dtype=torch.float64, eps=0.0)
    torch.testing.assert_close(out, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_trace_gives_the_stack_norm(dtype: torch.dtype) -> None:
    """‖X‖_F² = tr(X·Xᵀ): the torch iteration reads its norm off the first Gram matrix."""
    x = torch.randn(3, 20, 70).to(dtype)
    from_gram = gram_inverse_norms(x @ x.mT, 1.02, 1e-7)
    from_stack = inverse_norms(x, 1.02, 1e-7)
    assert from_gram.shape == from_stack.shape == (3,)
    # bf16 rounds each squared row norm once: the trace stays within 2**-9 relative.
    torch.testing.assert_close(
        from_gram, from_stack, rtol=2**-9 if dtype == torch.bfloat16 else 1e-6, atol=0
    )


def test_scale_matrices_scales_each_matrix_by_its_factor() -> None:
    x = torch.randn(4, 6, 5)
    factors = torch.tensor([0.5, 2.0, -1.0, 3.0])
    expected = x * factors.view(-1, 1, 1)
    assert torch.equal(scale_matrices_(x, factors), expected)


def test_scale_invariance_and_overflow() -> None:
    """The first Gram matrix sees raw squares; any input whose norm is representable (and
    well above ``eps``) gives the same result, and one whose norm overflows is reported as
    non-finite rather than returned as zeros."""
    x = torch.randn(24, 40)
    reference = newton_schulz(x, dtype=torch.float32)
    for scale in (1e-3, 1e15):
        scaled = newton_schulz(scale * x, dtype=torch.float32)
        torch.testing.assert_close(scaled, reference, rtol=1e-4, atol=1e-5)
    assert not newton_schulz(1e25 * x, dtype=torch.float32).isfinite().all()


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (2, 24, 40)])
def test_input_is_left_unchanged(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    before = x.clone()
    newton_schulz(x, steps=3, dtype=torch.float32)
    assert torch.equal(x, before)


def test_explicit_coefficients_and_schedule_expansion() -> None:
    x = torch.randn(20, 30)
    named = newton_schulz(x, steps=3, coefficients="keller", dtype=torch.float32)
    explicit = newton_schulz(
        x, steps=3, coefficients=[(3.4445, -4.7750, 2.0315)], dtype=torch.float32
    )
    torch.testing.assert_close(named, explicit)
    schedule = resolve_coefficients("quintic", 7)
    assert len(schedule.steps) == 7 and schedule.steps[5] == schedule.steps[4]


@pytest.mark.parametrize(
    ("coefficients", "steps", "message"),
    [
        ("cubic", 5, "coefficients='cubic'"),
        ([(1.0, 2.0)], 5, r"\(a, b, c\)"),
        ("quintic", 0, "ns_steps"),
    ],
)
def test_bad_coefficients_raise(coefficients: object, steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_coefficients(coefficients, steps)  # type: ignore[arg-type]


def test_triton_backend_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel tests turn it on
    with pytest.raises(RuntimeError, match="backend='triton' needs"):
        newton_schulz(torch.randn(4, 4), backend="triton")
