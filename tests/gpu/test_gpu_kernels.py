"""The Triton kernels on a CUDA GPU, where bf16 can be tested (`pytest -m gpu`).

The CPU tests run Triton's interpreter in fp32 only; these cover what they cannot: bf16 and
fp16 tensor-core products, compiled masking on shapes off the tile sizes, a batch past
2**31 elements (64-bit offsets), and the full iteration in bf16, whose error against
float64 must be at most 1.5x the torch bf16 reference's on the same input, never NaN. They
also check the fused momentum and update passes against torch's adds with bf16 state and
outputs, and past 2**31 elements, and the per-matrix reductions (norms, finiteness sums)
against float64, past 2**31 elements too.

The Triton modules are imported inside the tests, so that collecting them works where
Triton is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from muon_dist.kernels import newton_schulz, newton_schulz_torch
from muon_dist.kernels.coefficients import COEFFICIENT_SETS
from muon_dist.kernels.dispatch import replays_from_graph
from muon_dist.rules.ops import advance_momentum

# Product tolerances against float64: fp32 is exact-product ("ieee"), bf16/fp16 round once.
PRODUCT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PRODUCT_SHAPES = [(1, 300, 700), (3, 129, 1000), (2, 1, 64), (5, 257, 513), (1, 2048, 2048)]
NS_SHAPES = [(300, 700), (1000, 129), (3, 257, 513), (2, 1536, 1024), (7, 96, 96), (4096, 4096)]
# Triton's bf16 Newton–Schulz error against float64, at most this multiple of torch's.
MAX_ERROR_RATIO = 1.5


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    torch.manual_seed(0)
    yield
    torch.cuda.empty_cache()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Equal up to two roundings to ``dtype`` at the tensor's scale: the fused pass rounds
    once where torch's adds may round an intermediate to the state dtype first."""
    diff = (out.float() - expected.float()).abs().max().item()
    bound = 2 * torch.finfo(dtype).eps * expected.float().abs().max().item()
    return diff <= bound, f"max diff {diff:.2e} (bound {bound:.2e})"


@pytest.mark.parametrize("shape", PRODUCT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(PRODUCT_TOL), ids=str)
def test_symmetric_products_match_float64(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """Every output element is written (NaN poison) and both products match float64."""
    from muon_dist.kernels.triton_kernels import sym_product

    tol = PRODUCT_TOL[dtype]
    batch, m, _ = shape
    # Unit-scale entries keep A·A inside fp16's range.
    P = (torch.randn(shape, device="cuda") / shape[-1] ** 0.5).to(dtype)
    A = torch.full((batch, m, m), float("nan"), device="cuda", dtype=dtype)
    sym_product(P, out=A)
    err = rel_err(A, P.double() @ P.double().mT)
    assert err < tol and not A.isnan().any(), f"gram: {err:.2e}"

    poly = torch.full_like(A, float("nan"))
    sym_product(A, out=poly, alpha=2.03, Y=A, beta=-4.78)
    ref = 2.03 * A.double() @ A.double() - 4.78 * A.double()
    err = rel_err(poly, ref)
    assert err < tol and not poly.isnan().any(), f"b·A + c·A·A: {err:.2e}"

    # The first Newton–Schulz step's epilogue: a scale per matrix and a diagonal.
    scale = torch.rand(batch, device="cuda") + 0.5
    sym_product(A, out=poly, alpha=2.03, Y=A, beta=-4.78, diag=3.44, scale=scale)
    eye = torch.eye(m, device="cuda", dtype=torch.float64)
    ref = (ref + 3.44 * eye) * scale.double().view(-1, 1, 1)
    err = rel_err(poly, ref)
    assert err < tol and not poly.isnan().any(), f"scaled, with diagonal: {err:.2e}"


def test_gram_of_a_batch_past_2_31_elements() -> None:
    """Only 64-bit batch offsets reach the last matrices."""
    from muon_dist.kernels.triton_kernels import sym_product

    batch, m, k = 33, 8192, 8192
    P = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, m, m, device="cuda", dtype=torch.bfloat16)
    sym_product(P, out=out)
    for index in (0, batch - 1):
        ref = P[index].float() @ P[index].float().mT
        err = rel_err(out[index], ref.double())
        assert err < 1e-2, f"matrix {index}: {err:.2e}"


@pytest.mark.parametrize("shape", NS_SHAPES, ids=str)
@pytest.mark.parametrize("coefficients", sorted(COEFFICIENT_SETS))
def test_triton_newton_schulz_error_within_torch_bf16(
    coefficients: str, shape: tuple[int, ...]
) -> None:
    X = torch.randn(shape, device="cuda")
    ref = newton_schulz_torch(X, steps=5, coefficients=coefficients, dtype=torch.float64)
    torch_err = rel_err(newton_schulz(X, 5, coefficients, backend="torch"), ref)
    out = newton_schulz(X, 5, coefficients, backend="triton")
    assert out.dtype == torch.bfloat16 and out.shape == X.shape
    assert not out.isnan().any()
    triton_err = rel_err(out, ref)
    detail = f"triton {triton_err:.2e} torch {torch_err:.2e}"
    assert triton_err <= MAX_ERROR_RATIO * torch_err, detail


def test_triton_newton_schulz_of_zeros_is_zero() -> None:
    out = newton_schulz(torch.zeros(3, 200, 100, device="cuda"), backend="triton")
    assert bool((out == 0).all())


def conditioned(shape: tuple[int, ...], smallest: float, rank: int | None = None) -> torch.Tensor:
    """A CUDA stack with singular values log-spaced from 1 to ``smallest``, zero past ``rank``."""
    *batch, m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(*batch, m, k, device="cuda"))
    v, _ = torch.linalg.qr(torch.randn(*batch, n, k, device="cuda"))
    s = torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), k, device="cuda")
    if rank is not None:
        s[rank:] = 0
    return (u * s) @ v.mT


def singular_values(out: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` largest singular values of each matrix, from its short side's Gram matrix."""
    o = out.double()
    gram = o @ o.mT if o.size(-2) <= o.size(-1) else o.mT @ o
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)[..., :rank]


GRAM_SHAPES = [(1024, 4096), (4096, 1024), (4, 768, 2048), (2, 1536, 4096)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rank_fraction", [None, 0.25], ids=["full_rank", "rank_deficient"])
@pytest.mark.parametrize("coefficients", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
def test_gram_bf16_singular_values_in_the_standard_band(
    shape: tuple[int, ...], coefficients: str, rank_fraction: float | None, backend: str
) -> None:
    """bf16 Gram Newton–Schulz on singular values 1e-4..1: no NaN, the output's singular
    values within 0.02 of the standard bf16 path's range, and its error against a float64
    iteration at most 1.5x the standard path's."""
    k = min(shape[-2:])
    rank = None if rank_fraction is None else int(k * rank_fraction)
    X = conditioned(shape, 1e-4, rank)
    gram = newton_schulz(X, coefficients=coefficients, backend=backend, method="gram")
    standard = newton_schulz(X, coefficients=coefficients, backend="torch", method="standard")
    assert not gram.isnan().any()
    top = singular_values(gram, rank or k)
    band = singular_values(standard, rank or k)
    assert band.min() - 0.02 <= top.min() and top.max() <= band.max() + 0.02, (
        f"Gram {top.min():.3f}..{top.max():.3f}, standard {band.min():.3f}..{band.max():.3f}"
    )
    ref = newton_schulz_torch(X.double(), coefficients=coefficients, dtype=torch.float64)
    assert rel_err(gram, ref) <= MAX_ERROR_RATIO * rel_err(standard, ref)


def test_launch_bound_stacks_replay_from_a_graph() -> None:
    """``backend="auto"`` with a cache replays launch-bound stacks from a CUDA graph: the
    same result as the eager call, a fresh tensor each time, and new input values are read.
    Eight 3072×768 matrices (36 MiB, a 150M model's MLP stack) are launch-bound; one
    4096×4096 matrix has enough work per launch."""
    from muon_dist.kernels.graphs import GraphCache

    assert replays_from_graph(torch.empty(8, 3072, 768, device="cuda", dtype=torch.bfloat16))
    assert not replays_from_graph(torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16))
    cache = GraphCache()
    X = torch.randn(2, 1024, 4096, device="cuda", dtype=torch.bfloat16)
    assert replays_from_graph(X)
    first = newton_schulz(X, graphs=cache)
    again = newton_schulz(X, graphs=cache)
    assert len(cache) == 1
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr()
    # In a graph its launches cost nothing, so "auto" runs the Triton kernels there.
    assert torch.equal(first, newton_schulz(X, backend="triton", method="gram"))
    Y = torch.randn_like(X)
    assert torch.equal(
        newton_schulz(Y, graphs=cache), newton_schulz(Y, backend="triton", method="gram")
    )


def test_auto_takes_triton_for_small_stacks_only_from_a_graph() -> None:
    """A launch-bound stack runs torch's kernels when launched eagerly and the Triton ones
    when it runs from a graph: replayed from a cache, or captured by the caller
    (``captured``), so a captured step and its eager twin run the same kernels. A stack
    above ``GRAPH_MAX_BYTES`` below the FLOP threshold keeps torch's either way."""
    from muon_dist.kernels.graphs import GRAPH_MAX_BYTES, GraphCache

    X = torch.randn(64, 896, 256, device="cuda", dtype=torch.bfloat16)
    eager = newton_schulz(X)
    assert torch.equal(eager, newton_schulz(X, backend="torch"))
    triton_result = newton_schulz(X, backend="triton")
    assert torch.equal(newton_schulz(X, captured=True), triton_result)
    assert torch.equal(newton_schulz(X, graphs=GraphCache()), triton_result)
    big = torch.randn(18, 3072, 768, device="cuda", dtype=torch.bfloat16)
    assert big.numel() * big.element_size() > GRAPH_MAX_BYTES
    assert torch.equal(newton_schulz(big, captured=True), newton_schulz(big, backend="torch"))


def test_graphed_stacks_of_any_size_replay_from_a_graph() -> None:
    """``graphed=True`` (Dion2's selected slices) replays a stack with enough work per launch
    from a graph: the eager result, a fresh tensor each time, new values read."""
    from muon_dist.kernels.graphs import GraphCache

    cache = GraphCache()
    X = torch.randn(3, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    assert not replays_from_graph(X) and replays_from_graph(X, graphed=True)
    first = newton_schulz(X, graphs=cache, graphed=True)
    assert len(cache) == 1
    again = newton_schulz(X, graphs=cache, graphed=True)
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr()
    assert torch.equal(first, newton_schulz(X))
    Y = torch.randn_like(X)
    assert torch.equal(newton_schulz(Y, graphs=cache, graphed=True), newton_schulz(Y))


def test_full_graph_cache_runs_new_shapes_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the graph cache is full, new small shapes run eagerly instead of evicting and
    capturing again: a capture synchronises, and a cycling cache would do it every step."""
    from muon_dist.kernels import graphs

    captures: list[int] = []
    capture = graphs._capture

    def counted(X: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> graphs._Graphed:
        captures.append(X.shape[-1])
        return capture(X, fn)

    monkeypatch.setattr(graphs, "_capture", counted)
    cache = graphs.GraphCache(capacity=2)
    stacks = [torch.randn(1, 256, n, device="cuda", dtype=torch.bfloat16) for n in (512, 640, 768)]
    for _ in range(3):
        for X in stacks:
            eager = newton_schulz(X, backend="triton", method="gram")
            assert torch.equal(newton_schulz(X, graphs=cache), eager)
    assert captures == [512, 640]


def test_graphs_are_freed_with_the_optimizer() -> None:
    """A Dion2 step's graphs (its selected slices replay whatever their size, ~5 times a
    256 MiB stack here) belong to the optimizer: deleting it returns their memory. The
    process keeps only what any CUDA work sets up (cuBLAS workspaces, under 64 MiB)."""
    import gc

    from torch import nn

    import muon_dist

    layers = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def cycle() -> int:
        # Eager steps: a captured step keeps no kernel graphs.
        opt = muon_dist.Muon(layers.parameters(), rule="dion2", cuda_graph=False)
        for _ in range(2):
            for p in layers.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        muon = opt.runner.muon
        assert muon is not None and len(muon.orthogonalizer.graphs) > 0
        for p in layers.parameters():
            p.grad = None
        del opt, muon
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before

    kept = [cycle() for _ in range(3)]
    assert max(kept) < 64 * 2**20 and len(set(kept)) == 1, kept


def _keep() -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device="cuda")


@pytest.mark.parametrize("mix", [0.95, None])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_momentum_pass_matches_torch(
    state_dtype: torch.dtype, out_dtype: torch.dtype, mix: float | None
) -> None:
    from muon_dist.kernels.triton_elementwise import momentum_input_triton

    grad = torch.randn(3, 1000, 1001, device="cuda", dtype=state_dtype)
    momentum = torch.randn_like(grad)
    advanced = advance_momentum(grad, momentum, 0.9)
    expected = advanced if mix is None else torch.add(grad, advanced, alpha=mix)
    out = torch.empty_like(grad, dtype=out_dtype)
    momentum_input_triton(grad, momentum, out, 0.9, mix, True, _keep())
    coarse = torch.bfloat16 if torch.bfloat16 in (state_dtype, out_dtype) else out_dtype
    ok, detail = close(out, expected.to(out_dtype), coarse)
    assert ok, f"Newton–Schulz input: {detail}"
    stored, detail = close(momentum, advanced, state_dtype)
    assert stored, f"stored momentum: {detail}"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_update_pass_matches_torch(state_dtype: torch.dtype) -> None:
    from muon_dist.kernels.triton_elementwise import decay_and_update_triton

    param = torch.randn(5, 777, 513, device="cuda", dtype=state_dtype)
    update = torch.randn_like(param, dtype=torch.bfloat16)
    expected = param.mul(0.998).add_(update, alpha=-0.02)
    decay, step = torch.tensor(0.998, device="cuda"), torch.tensor(-0.02, device="cuda")
    decay_and_update_triton(param, update, decay, step, _keep())
    ok, detail = close(param, expected, state_dtype)
    assert ok, detail


def test_fused_momentum_pass_past_2_31_elements() -> None:
    """64-bit offsets: the last elements of a tensor past 2**31 elements are written."""
    from muon_dist.kernels.triton_elementwise import momentum_input_triton

    numel = 2**31 + 4100
    grad = torch.ones(numel, device="cuda")
    momentum = torch.full_like(grad, 2.0)
    out = torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
    momentum_input_triton(grad, momentum, out, 0.5, 1.0, True, _keep())
    assert bool((out[-5000:] == 3.0).all()), "Newton–Schulz input tail not written"
    assert bool((momentum[-5000:] == 2.0).all()), "momentum tail changed"


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_row_scaling_matches_torch(dtype: torch.dtype, columns: bool) -> None:
    """NorMuon's row scaling: fp32 product rounded once to the dtype, as torch's in-place
    broadcast multiply rounds it: bitwise equal."""
    from muon_dist.kernels.triton_elementwise import scale_rows_triton

    x = torch.randn(5, 777, 513, device="cuda", dtype=dtype)
    factors = torch.rand(5, 513 if columns else 777, device="cuda")
    expected = x.clone().mul_(factors.unsqueeze(-2) if columns else factors.unsqueeze(-1))
    scale_rows_triton(x, factors, columns)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


@pytest.mark.parametrize("primary", [False, True])
def test_fused_row_factors_match_torch(primary: bool) -> None:
    """NorMuon's one-launch factors: fp32 sums in another order, so within fp32 rounding;
    the reported sums of squares bitwise."""
    from muon_dist.kernels.triton_elementwise import row_factors_triton
    from muon_dist.rules.normuon_rows import owner_row_factors

    k, rows, total = 6, 3000, 20000
    squares = torch.rand(k, rows, device="cuda") * 4
    index = torch.randperm(total, device="cuda")[: k * rows].view(k, rows)
    current, beta2, weight = (torch.rand(total, device="cuda") for _ in range(3))
    coefficients = (current, beta2, weight, torch.full((total,), 1e-8, device="cuda"))
    flags = torch.rand(k, 1, device="cuda") > 0.5 if primary else None
    expected_sums = torch.zeros(total, device="cuda")
    sums = torch.zeros(total, device="cuda")
    expected = owner_row_factors(squares, index, coefficients, flags, expected_sums)
    got = row_factors_triton(squares, index, *coefficients, flags, sums)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert torch.equal(sums, expected_sums)


@pytest.mark.parametrize("axis", [-2, -1], ids=["rows", "columns"])
def test_fused_slice_norms_match_torch(axis: int) -> None:
    """Dion2's float64 L1 norms of bf16 slices: exact sums, so equal to torch's bitwise."""
    from muon_dist.kernels.triton_elementwise import slice_l1_triton

    x = torch.randn(5, 777, 513, device="cuda", dtype=torch.bfloat16)
    expected = x.abs().sum(-1 if axis == -2 else -2, dtype=torch.float64)
    torch.testing.assert_close(slice_l1_triton(x, axis), expected, rtol=0, atol=0)


def test_fused_error_feedback_matches_torch() -> None:
    from muon_dist.kernels.triton_elementwise import error_feedback_triton
    from muon_dist.rules.ops import error_feedback_

    update = torch.randn(5, 777, 513, device="cuda", dtype=torch.bfloat16)
    update[:, ::3] = 0.0
    update[:, 1::3, ::2] = -0.0
    momentum = torch.randn(5, 777, 513, device="cuda")
    expected = momentum.clone()
    error_feedback_(expected, update, 0.95, _keep())
    error_feedback_triton(momentum, update, 0.95, _keep())
    torch.testing.assert_close(momentum, expected, rtol=0, atol=0)


@pytest.mark.parametrize("axis", [-2, -1], ids=["rows", "columns"])
def test_fused_slice_norms_add_at_shared_slots(axis: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial norms of bf16 slices of several tensors (each layout of strides) added at
    slots they share, each slice over several programs (atomic float64 adds of exact
    sums): ``index_add_`` bitwise."""
    from muon_dist.kernels import triton_elementwise
    from muon_dist.kernels.triton_elementwise import add_slice_l1_triton
    from muon_dist.rules.dion2_slices import add_slice_norms_

    monkeypatch.setattr(triton_elementwise, "_SLICE_CHUNK", 256)
    xs = [
        torch.randn(2, 513, 777, device="cuda", dtype=torch.bfloat16).mT,
        torch.randn(3, 777, 513, device="cuda", dtype=torch.bfloat16),
        torch.randn(2, 1554, 1026, device="cuda", dtype=torch.bfloat16)[:, ::2, ::2],
    ]
    count = xs[0].shape[axis]
    shared = torch.randperm(1000, device="cuda")[:count]
    slots = [shared.expand(x.shape[0], count).contiguous() for x in xs]
    expected = torch.zeros(1000, dtype=torch.float64, device="cuda")
    norms = expected.clone()
    add_slice_norms_(expected, xs, [axis] * 3, slots)
    add_slice_l1_triton(norms, xs, [axis] * 3, slots)
    torch.testing.assert_close(norms, expected, rtol=0, atol=0)


# Pieces of a fused batch: several blocks, one partial block, a few elements.
FUSED_SHAPES = [(1000, 1001), (64, 257), (7,)]


@pytest.mark.parametrize("mix", [0.95, None])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("momentum_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("store", [True, False])
def test_fused_read_equals_the_torch_form_bitwise(
    momentum_dtype: torch.dtype, out_dtype: torch.dtype, mix: float | None, store: bool
) -> None:
    """The step's two forms of the momentum read (fp32 gradients) round alike: the fused
    pass may replace torch's on any piece without changing a bit of the step."""
    from muon_dist.rules.ops import pre_orthogonalize_

    grads = [torch.randn(s, device="cuda") for s in FUSED_SHAPES]
    momenta = [torch.randn(s, device="cuda").to(momentum_dtype) for s in FUSED_SHAPES]
    keeps = [_keep() for _ in FUSED_SHAPES]
    results = []
    for fused in (True, False):
        mine = [m.clone() for m in momenta]
        outs = [torch.empty(s, device="cuda", dtype=out_dtype) for s in FUSED_SHAPES]
        pre_orthogonalize_(
            grads, mine, outs, beta=0.9, mix=mix, keeps=keeps, store=store, fused=fused
        )
        results.append(mine + outs)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("update_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_write_equals_the_torch_form_bitwise(update_dtype: torch.dtype) -> None:
    """The fused write of fp32 parameters equals torch's batched one (decay of the whole
    tensor, then a step shared by the pieces: cast, scale, add), bitwise."""
    from muon_dist.rules.ops import decay_, fused_updates_, shared_step_updates_

    params = [torch.randn(s, device="cuda") for s in FUSED_SHAPES]
    updates = [torch.randn(s, device="cuda").to(update_dtype) for s in FUSED_SHAPES]
    decay, step = torch.tensor(0.998, device="cuda"), torch.tensor(-0.02, device="cuda")
    fused = [p.clone() for p in params]
    fused_updates_(
        fused,
        updates,
        decays=[decay] * len(params),
        steps=[step] * len(params),
        keeps=[_keep() for _ in params],
        feedbacks=[None] * len(params),
    )
    decay_(params, decay)
    scratch = torch.empty(sum(p.numel() for p in params), device="cuda")
    pieces = torch.split(scratch, [p.numel() for p in params])
    scaled = [v.view(p.shape) for v, p in zip(pieces, params, strict=True)]
    shared_step_updates_(params, updates, step, scratch, scaled)
    assert all(torch.equal(a, b) for a, b in zip(fused, params, strict=True))


def test_fused_step_equals_the_torch_step_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three fp32 steps of Muon with the fused passes on every piece (the CUDA default)
    and with torch's forms (``backend="torch"``) agree in every bit, Newton–Schulz held to
    torch's in both (small stacks replayed from graphs would take the Triton kernels)."""
    import muon_dist
    from muon_dist.kernels import dispatch

    monkeypatch.setattr(dispatch, "auto_uses_triton", lambda *args: False)

    shapes = [(256, 256), (64, 256), (896, 256), (256, 896), (4, 48, 32)]
    runs = []
    for backend in ("auto", "torch"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
        groups = [
            {"params": params[:4], "algorithm": "muon", "weight_decay": 0.1},
            {"params": params[4:], "algorithm": "muon", "experts": True},
        ]
        opt = muon_dist.Muon(
            groups,
            lr=0.02,
            backend=backend,
            comm_dtype=torch.float32,
            ns_dtype=torch.float32,
            cuda_graph=False,
        )
        for step in range(3):
            grads = torch.Generator(device="cuda").manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=grads)
            opt.step()
        runs.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_fused_write_with_error_feedback_matches_torch() -> None:
    """Dion2's write in one pass: the parameter as the fused plain write's, the momentum
    as torch's error feedback, both bitwise."""
    from muon_dist.rules.ops import error_feedback_, post_orthogonalize_

    update = torch.randn(777, 513, device="cuda", dtype=torch.bfloat16)
    update[::3] = 0.0
    update[1::3, ::2] = -0.0
    param, momentum = torch.randn(777, 513, device="cuda"), torch.randn(777, 513, device="cuda")
    scalars = {
        "decay": torch.tensor(0.998, device="cuda"),
        "step": torch.tensor(-0.02, device="cuda"),
        "keep": _keep(),
    }
    expected_param, expected_momentum = param.clone(), momentum.clone()
    post_orthogonalize_(expected_param, update, **scalars, fused=True)
    error_feedback_(expected_momentum, update, 0.95, _keep())
    post_orthogonalize_(param, update, **scalars, fused=True, feedback=(momentum, 0.95))
    assert torch.equal(param, expected_param) and torch.equal(momentum, expected_momentum)


def test_many_pieces_in_one_launch_match_one_per_piece() -> None:
    """The address-table launches (reads and writes with Dion2's feedback, bf16 and fp32,
    sizes from 0 to many blocks, one piece masked) equal one launch per piece, bitwise."""
    from muon_dist.kernels import triton_elementwise as te

    sizes = [4097, 0, 1, 3 * 4096 + 5, 700, 2**20 + 3]
    keeps = [torch.tensor(i != 2, device="cuda") for i in range(len(sizes))]
    grads = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    momenta = [torch.randn(n, device="cuda") for n in sizes]
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    want_momenta, want_outs = [m.clone() for m in momenta], [o.clone() for o in outs]
    for args in zip(grads, want_momenta, want_outs, keeps, strict=True):
        te.momentum_input_triton(*args[:3], 0.9, 0.95, True, args[3])
    te.momentum_inputs_triton(grads, momenta, outs, 0.9, 0.95, True, keeps)
    got, wanted = momenta + outs, want_momenta + want_outs
    assert all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))

    params = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    decays = [torch.tensor(0.99, device="cuda") for _ in sizes]
    steps = [torch.tensor(-0.01 * (i + 1), device="cuda") for i in range(len(sizes))]
    feedbacks = [(m, 0.9) if i % 2 else None for i, m in enumerate(momenta)]
    want = [(p.clone(), m.clone()) for p, m in zip(params, momenta, strict=True)]
    for (p, m), u, d, s, k, f in zip(want, outs, decays, steps, keeps, feedbacks, strict=True):
        te.decay_and_update_triton(p, u, d, s, k, None if f is None else (m, 0.9))
    te.decay_and_updates_triton(params, outs, decays, steps, keeps, feedbacks)
    for p, m, (want_p, want_m) in zip(params, momenta, want, strict=True):
        assert torch.equal(p, want_p) and torch.equal(m, want_m)


def test_fused_stack_mask_matches_masked_fill() -> None:
    """The stack mask in bf16 past one block per matrix: dropped matrices zero (NaN
    included), kept ones bitwise unchanged, as ``masked_fill_``."""
    from muon_dist.kernels.triton_elementwise import zero_dropped_triton

    stack = torch.randn(6, 96, 1000, device="cuda", dtype=torch.bfloat16)
    stack[2, 5, 7] = float("nan")
    dropped = torch.tensor([True, False, True, False, False, True], device="cuda")
    expected = stack.clone().masked_fill_(dropped.view(-1, 1, 1), 0.0)
    zero_dropped_triton(stack, dropped)
    assert torch.equal(stack, expected)


@pytest.mark.parametrize("shape", [(1, 4096, 4096), (3, 777, 513), (2, 1024, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_matrix_reductions_match_float64(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Per-matrix sums and sums of squares within fp32 rounding of float64 (a bound from
    Σ|x|), the inverse norms within fp32 rounding of float64's and their squares bitwise
    torch's, the same bits on a second call, and the optimizer's fused finiteness sums equal
    to the kernel's."""
    from muon_dist.kernels.triton_reduce import inverse_norms_triton, matrix_sums_triton
    from muon_dist.rules.ops import matrix_sums

    x = torch.randn(shape, device="cuda").to(dtype)
    values = x.double().flatten(1)
    for squares, exact in ((False, values), (True, values.square())):
        got = matrix_sums_triton(x, squares)
        assert bool(((got.double() - exact.sum(1)).abs() <= 1e-5 * exact.abs().sum(1)).all())
        assert torch.equal(got, matrix_sums_triton(x, squares))
    norms, squared = inverse_norms_triton(x, 1.02, 1e-7)
    exact = 1.0 / (1.02 * values.square().sum(1).sqrt() + 1e-7)
    torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0)
    assert torch.equal(norms, inverse_norms_triton(x, 1.02, 1e-7)[0])
    assert torch.equal(squared, norms.square())
    fused = torch.empty(shape[0], device="cuda")
    matrix_sums(x, fused, "triton")
    assert torch.equal(fused, matrix_sums_triton(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_many_tensor_norms_and_verdicts_match_torch(dtype: torch.dtype) -> None:
    """The agreement's fused norms of many tensors (0 to 4M elements) within float64 rounding
    of torch's, the same bits on a second call, and each verdict at its position: non-finite,
    above its limit, or neither."""
    from muon_dist.kernels.triton_reduce import norm_verdicts_triton

    sizes = [4 << 20, 0, 1, 3000, 65536, 917504, 17, 229376]
    tensors = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    tensors[3][7] = float("nan")
    tensors[5][-1] = float("inf")
    tensors[7].mul_(100)
    positions = torch.tensor([9, 0, 2, 5, 1, 7, 3, 4], device="cuda")
    limits = torch.full((10,), 1e4, device="cuda")
    limits[9] = float("inf")
    verdicts = torch.full((10,), -1.0, device="cuda")
    norms = norm_verdicts_triton(tensors, positions, limits, verdicts, 2.0, 1.0)
    expected = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    torch.testing.assert_close(norms, expected, rtol=1e-12, atol=0, equal_nan=True)
    assert verdicts[positions].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 2.0]
    again = torch.full((10,), -1.0, device="cuda")
    second = norm_verdicts_triton(tensors, positions, limits, again, 2.0, 1.0)
    torch.testing.assert_close(second, norms, rtol=0, atol=0, equal_nan=True)  # same bits
    assert torch.equal(again, verdicts)


def test_matrix_reductions_past_2_31_elements() -> None:
    """64-bit offsets: the last matrix of a stack past 2**31 elements is read to its last
    element. The kernel's sums of ones and twos are exact in fp32: every partial sum of its
    blocked order is a small integer times a power of two."""
    from muon_dist.kernels.triton_reduce import matrix_sums_triton

    x = torch.ones(33, 8192, 8192, device="cuda", dtype=torch.bfloat16)
    x[-1] = 2.0
    x[-1, -1, -1] = float("inf")
    sums = matrix_sums_triton(x)
    assert bool((sums[:-1] == 2.0**26).all()) and sums[-1].item() == float("inf")
    x[-1, -1, -1] = 2.0
    assert matrix_sums_triton(x)[-1].item() == 2.0**27
    assert matrix_sums_triton(x, squares=True)[-1].item() == 2.0**28


def _captured_garbage() -> None:
    """A captured graph dropped in a reference cycle: only the cyclic collector frees it,
    and freeing it destroys its executable graph and releases its memory pool."""
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(8, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)
    cycle: list[object] = [graph, x]
    cycle.append(cycle)


def test_a_collection_during_capture_cannot_invalidate_it() -> None:
    """Garbage whose destructor calls the CUDA driver (a loaded Triton kernel dropped in a
    reference cycle unloads its module; a dropped graph destroys its executable) is not
    finalized inside a capture: ``capturing`` pauses the collector, even one set to run at
    nearly every allocation, and restores it."""
    import gc

    import triton
    import triton.language as tl

    from muon_dist.kernels.graphs import capturing

    @triton.jit  # type: ignore[untyped-decorator]
    def fill(out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, 1.0, mask=offsets < n)

    ones = torch.zeros(64, device="cuda")
    fill[(1,)](ones, 64, BLOCK=64)
    X = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
    expected = newton_schulz(X, backend="triton")  # compiled and tuned before the capture
    torch.cuda.synchronize()
    cycle: list[object] = [fill]
    cycle.append(cycle)
    del fill, cycle
    _captured_garbage()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            result = newton_schulz(X, backend="triton")
        assert gc.isenabled()
    finally:
        gc.set_threshold(*threshold)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result, expected) and bool(ones.eq(1).all())


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_step_scalars_in_one_launch_equal_the_torch_form_bitwise(found_inf: float) -> None:
    from step_scalars import assert_bitwise_equal, both_forms

    sizes = (300, 517, 5, 9, 1200)
    _, _, expected, fused = both_forms(sizes, found_inf, drop=True, seed=1, device="cuda")
    assert_bitwise_equal(expected, fused)


@pytest.mark.parametrize("case", ["nothing found", "a value differs", "a bad result"])
def test_agreement_decisions_in_one_launch_equal_the_torch_forms_bitwise(case: str) -> None:
    from agreement_flags import count_both_forms, settle_both_forms

    settle_both_forms(case, 2500, device="cuda")
    count_both_forms(with_dropped=True, device="cuda")
