"""The per-matrix reductions on CPU through Triton's interpreter, against float64 sums.

conftest.py turns the interpreter on (TRITON_INTERPRET=1) before Triton is imported, on
machines without CUDA. bf16 loads work there (only the interpreter's bf16 ``tl.dot`` does
not, and these kernels take none). Most tests shrink the block and chunk sizes, so a small
matrix spans several chunks of several blocks each, with a partial last block; a stack past
2**31 elements (64-bit offsets) is checked on a GPU (tests/gpu/test_gpu_kernels.py).
"""

from collections.abc import Iterator

import pytest
import torch

from muon_dist.kernels.availability import interpret_mode
from muon_dist.kernels.torch_ns import inverse_norms

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_reduce = pytest.importorskip("muon_dist.kernels.triton_reduce")

# Matrices of 1 to 6500 elements: k=1, a single row, sizes off every block size.
SHAPES = [(1, 50, 70), (3, 33, 130), (2, 1, 40), (4, 16, 16), (70, 50), (2, 3, 65, 100)]
DTYPES = [torch.float32, torch.bfloat16]
# fp32 sums in blocks: a few dozen roundings at most, each within 2**-24 of the magnitudes.
TOL = 1e-5


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Blocks of 256 elements, up to 5 chunks per matrix, partials summed 2 at a time."""
    monkeypatch.setattr(triton_reduce, "_BLOCK", 256)
    monkeypatch.setattr(triton_reduce, "_CHUNKS", 3)
    monkeypatch.setattr(triton_reduce, "_TOTALS_BLOCK", 2)
    yield


def reference(x: torch.Tensor, squares: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 sums per matrix and the bound on an fp32 sum's error (from Σ|x|)."""
    values = x.double().reshape(-1, x.shape[-2] * x.shape[-1])
    values = values.square() if squares else values
    return values.sum(-1), TOL * values.abs().sum(-1)


def assert_sums_close(got: torch.Tensor, x: torch.Tensor, squares: bool) -> None:
    expected, bound = reference(x, squares)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert bool(((got.double() - expected).abs() <= bound).all()), (got, expected)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("squares", [False, True], ids=["sum", "squares"])
def test_sums_match_float64(shape: tuple[int, ...], dtype: torch.dtype, squares: bool) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert_sums_close(triton_reduce.matrix_sums_triton(x, squares), x, squares)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_blocks_match_float64(dtype: torch.dtype) -> None:
    """The production sizes: 10,000 elements are a full block and a partial one."""
    x = torch.randn(2, 100, 100, generator=torch.Generator().manual_seed(1)).to(dtype)
    for squares in (False, True):
        assert_sums_close(triton_reduce.matrix_sums_triton(x, squares), x, squares)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("shape", [(1, 50, 70), (3, 70, 33)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inverse_norms_match_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """``1/(s·‖Y‖+eps)`` within fp32 rounding of torch's and of the float64 value, and its
    square bitwise torch's square of it."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, squared = triton_reduce.inverse_norms_triton(x, 1.02, 1e-7)
    exact = 1.0 / (1.02 * x.double().square().sum((-2, -1)).sqrt() + 1e-7)
    assert got.dtype == squared.dtype == torch.float32
    assert torch.equal(squared, got.square())
    torch.testing.assert_close(got, inverse_norms(x, 1.02, 1e-7), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


def test_zero_matrices() -> None:
    """Zero sums, and ``1/eps`` as torch's inverse norm gives it, bitwise; empty matrices
    sum to zero, and an empty stack gives no sums."""
    x = torch.randn(3, 40, 50)
    x[1] = 0.0
    assert triton_reduce.matrix_sums_triton(x)[1].item() == 0.0
    assert triton_reduce.matrix_sums_triton(x, squares=True)[1].item() == 0.0
    got, squared = triton_reduce.inverse_norms_triton(x, 1.02, 1e-7)
    assert torch.equal(got[1], inverse_norms(x, 1.02, 1e-7)[1])
    assert torch.equal(squared, got.square())
    assert torch.equal(triton_reduce.matrix_sums_triton(torch.ones(2, 0, 5)), torch.zeros(2))
    assert triton_reduce.matrix_sums_triton(torch.ones(0, 4, 5)).shape == (0,)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf − inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_entries_give_non_finite_sums(dtype: torch.dtype) -> None:
    """One inf, one NaN, or an inf and a −inf (which cancel to NaN) anywhere in a matrix
    make its sum non-finite, and leave the other matrices' sums finite."""
    x = torch.randn(5, 33, 70, dtype=dtype)
    x[1, 32, 69] = float("inf")
    x[2, 0, 0] = float("nan")
    x[3, 5, 7], x[3, 20, 60] = float("inf"), float("-inf")
    finite = torch.tensor([True, False, False, False, True])
    assert torch.equal(torch.isfinite(triton_reduce.matrix_sums_triton(x)), finite)
    squares = triton_reduce.matrix_sums_triton(x, squares=True)
    assert torch.equal(torch.isfinite(squares), finite)
    got, _ = triton_reduce.inverse_norms_triton(x, 1.0, 1e-7)
    expected = inverse_norms(x, 1.0, 1e-7)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.usefixtures("small_blocks")
def test_strided_stacks() -> None:
    """Matrices a batch stride apart (every other one of a stack) and column-major ones
    (a transposed view) are read in place; matrices with gaps inside are copied first."""
    big = torch.randn(6, 30, 50, generator=torch.Generator().manual_seed(3))
    for x in (big[1::2], big.mT, big[:, ::2, ::3], big[5]):
        for squares in (False, True):
            assert_sums_close(triton_reduce.matrix_sums_triton(x, squares), x, squares)
    assert triton_reduce._matrix_rows(big[1::2], 30 * 50).data_ptr() == big[1].data_ptr()
    assert triton_reduce._matrix_rows(big.mT, 30 * 50).data_ptr() == big.data_ptr()


@pytest.mark.usefixtures("small_blocks")
def test_runs_are_bitwise_equal_and_matrices_independent() -> None:
    """Two calls give the same bits, and a matrix's sum is the same bits alone or in a
    stack: its chunks depend on its size only, and no atomics reorder the sums."""
    x = torch.randn(3, 40, 70, generator=torch.Generator().manual_seed(4)).bfloat16()
    for squares in (False, True):
        first = triton_reduce.matrix_sums_triton(x, squares)
        assert torch.equal(first, triton_reduce.matrix_sums_triton(x, squares))
        assert torch.equal(first[2:3], triton_reduce.matrix_sums_triton(x[2], squares))


def test_writes_into_out() -> None:
    """Into a slice of a longer buffer (the optimizer's per-matrix sums), nowhere else; a
    wrong ``out`` is refused."""
    x = torch.randn(3, 20, 30)
    buffer = torch.full((7,), -1.0)
    triton_reduce.matrix_sums_triton(x, out=buffer[2:5])
    assert_sums_close(buffer[2:5], x, squares=False)
    assert bool((buffer[:2] == -1.0).all() and (buffer[5:] == -1.0).all())
    with pytest.raises(ValueError, match="out must be"):
        triton_reduce.matrix_sums_triton(x, out=torch.empty(4))
    with pytest.raises(ValueError, match="a matrix or a stack"):
        triton_reduce.matrix_sums_triton(torch.ones(5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tensor_norms_and_verdicts_match_torch(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float64 norms of tensors of 0 to 5000 elements, each summed over several programs of
    several blocks, and the verdict at each one's position: non-finite (a NaN, an inf),
    above its limit, or neither, as the agreement's torch form decides."""
    monkeypatch.setattr(triton_reduce, "_NORM_BLOCK", 64)
    monkeypatch.setattr(triton_reduce, "_PARTS", 4)
    generator = torch.Generator().manual_seed(3)
    sizes = [5000, 0, 1, 300, 64, 257, 4100, 900]
    tensors = [torch.randn(n, generator=generator).to(dtype) for n in sizes]
    tensors[3][7] = float("nan")
    tensors[6][4000] = float("inf")
    tensors[7].mul_(1e4)  # above its limit below
    positions = torch.tensor([9, 0, 2, 5, 1, 7, 3, 4])
    limits = torch.full((10,), 1e3)
    limits[7] = float("inf")  # an AdamW parameter: no limit
    limits[4] = 1e3  # tensors[7], whose norm is about 3e5
    verdicts = torch.full((10,), -1.0)
    norms = triton_reduce.norm_verdicts_triton(tensors, positions, limits, verdicts, 2.0, 1.0)

    expected = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    torch.testing.assert_close(norms, expected, rtol=1e-13, atol=0, equal_nan=True)
    verdict = torch.where(
        torch.isfinite(expected),
        (expected > limits[positions].double()).float() * 2.0,
        torch.ones_like(expected, dtype=torch.float32),
    )
    assert torch.equal(verdicts[positions], verdict)
    assert verdicts[positions].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 2.0]
    untouched = [i for i in range(10) if i not in positions.tolist()]
    assert verdicts[untouched].eq(-1.0).all()
