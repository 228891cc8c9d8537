"""The fused momentum and update passes on CPU through Triton's interpreter, against torch.

conftest.py turns the interpreter on (TRITON_INTERPRET=1) before Triton is imported, on
machines without CUDA. The state is fp32 here, except in the bf16 momentum tests
(``momentum_dtype="bf16"``: fp32 gradients and arithmetic, bf16 storage): the interpreter
rounds fp32 to bf16 toward zero where a GPU rounds to nearest, so those hold the stored
momentum to one bf16 ulp of the correctly rounded value and check what does not depend on
the rounding (which entries change, and that the Nesterov mix reads the stored, rounded
momentum); tests/gpu/test_gpu_kernels.py holds the GPU's to torch's.
"""

import pytest
import torch
from step_scalars import assert_bitwise_equal, both_forms

from muon_dist.kernels.availability import interpret_mode
from muon_dist.rules import ops
from muon_dist.rules.forms import fused_form
from muon_dist.rules.ops import (
    advance_momentum,
    matrix_sums,
    post_orthogonalize_,
    pre_orthogonalize_,
)

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_elementwise = pytest.importorskip("muon_dist.kernels.triton_elementwise")

# Sizes around the kernel's 4096-element blocks, and a 3-D shape like an expert stack piece.
SHAPES = [(1,), (4095,), (4097,), (3, 50, 70)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mix", [0.95, None])
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_momentum_input_matches_torch(
    shape: tuple[int, ...], mix: float | None, store: bool, out_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    grad = torch.randn(shape)
    momentum = torch.randn(shape)
    expected_momentum = momentum.clone()
    expected = torch.empty(shape, dtype=out_dtype)
    keep = torch.tensor(True)
    rule = {"beta": 0.9, "mix": mix, "keeps": [keep], "store": store}
    pre_orthogonalize_([grad], [expected_momentum], [expected], **rule, fused=False)  # torch form
    out = torch.full(shape, float("nan"), dtype=out_dtype)
    before = momentum.clone()
    pre_orthogonalize_([grad], [momentum], [out], **rule, fused=True)
    torch.testing.assert_close(out, expected)
    if store:
        torch.testing.assert_close(momentum, advance_momentum(grad, before, 0.9))
    else:
        assert torch.equal(momentum, before), "store=False must leave the momentum alone"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("decay", [1.0, 0.998])
def test_decay_and_update_matches_torch(shape: tuple[int, ...], decay: float) -> None:
    torch.manual_seed(1)
    param = torch.randn(shape)
    update = torch.randn(shape).bfloat16()
    expected = param.clone()
    scalars = {
        "decay": torch.tensor(decay),
        "step": torch.tensor(-0.02),
        "keep": torch.tensor(True),
    }
    post_orthogonalize_(expected, update, **scalars, fused=False)  # torch form
    post_orthogonalize_(param, update, **scalars, fused=True)
    torch.testing.assert_close(param, expected)


@pytest.mark.parametrize("keep", [True, False])
def test_write_with_error_feedback_matches_torch(keep: bool) -> None:
    """Dion2's write in one pass equals the torch form's decay, update and error feedback:
    the momentum bitwise (decayed exactly where the update is nonzero or a negative zero,
    and only when kept), the parameter as the plain write's."""
    torch.manual_seed(2)
    update = torch.randn(6, 700).bfloat16()
    update[1] = 0.0
    update[2, ::3] = -0.0
    param, momentum = torch.randn(6, 700), torch.randn(6, 700)
    scalars = {
        "decay": torch.tensor(0.998 if keep else 1.0),
        "step": torch.tensor(-0.02 if keep else 0.0),
        "keep": torch.tensor(keep),
    }
    results = []
    for fused in (False, True):
        p, m = param.clone(), momentum.clone()
        post_orthogonalize_(p, update, **scalars, fused=fused, feedback=(m, 0.9))
        results.append((p, m))
    (p_torch, m_torch), (p_fused, m_fused) = results
    torch.testing.assert_close(p_fused, p_torch)
    assert torch.equal(m_fused, m_torch)
    decayed = m_torch != momentum
    assert torch.equal(decayed, ((update != 0) | torch.signbit(update)) & keep)


@pytest.mark.parametrize("fused", [False, True])
def test_masked_matrices_stay_bitwise_unchanged(fused: bool) -> None:
    """keep=False leaves momentum and weights bitwise alone, even under a NaN gradient (with
    the decay 1 and step 0 the optimizer computes for a masked tensor)."""
    grad = torch.full((4097,), float("nan"))
    momentum, param = torch.randn(4097), torch.randn(4097)
    before = (momentum.clone(), param.clone())
    keep = torch.tensor(False)
    out = torch.empty(4097, dtype=torch.bfloat16)
    pre_orthogonalize_(
        [grad], [momentum], [out], beta=0.9, mix=0.95, keeps=[keep], store=True, fused=fused
    )
    update = torch.zeros(4097, dtype=torch.bfloat16)
    scalars = {"decay": torch.tensor(1.0), "step": torch.tensor(0.0), "keep": keep}
    post_orthogonalize_(param, update, **scalars, fused=fused)
    assert torch.equal(momentum, before[0]) and torch.equal(param, before[1])


def test_cpu_dispatch_uses_torch_arithmetic() -> None:
    """On CPU the rule takes the torch form: the same two torch adds the optimizer always ran."""
    torch.manual_seed(2)
    grad, momentum = torch.randn(2, 300, 300), torch.randn(2, 300, 300)
    out = torch.empty(2, 300, 300, dtype=torch.bfloat16)
    advanced = torch.add(grad, momentum, alpha=0.9)
    expected = torch.add(grad, advanced, alpha=0.95).bfloat16()
    assert not fused_form("auto", grad, momentum, out)
    keep = torch.tensor(True)
    pre_orthogonalize_(
        [grad], [momentum], [out], beta=0.9, mix=0.95, keeps=[keep], store=True, fused=False
    )
    assert torch.equal(momentum, advanced) and torch.equal(out, expected)


@pytest.mark.parametrize("primary", [None, [True, False, True]], ids=["all", "some"])
@pytest.mark.parametrize("rows", [5, 1500], ids=str)
def test_row_factors_match_torch(primary: list[bool] | None, rows: int) -> None:
    """NorMuon's one-launch factors against the torch form, rows scattered in the vectors."""
    from muon_dist.rules.normuon_rows import owner_row_factors

    torch.manual_seed(0)
    k, total = 3, 3 * rows + 7
    squares = torch.rand(k, rows) * 4
    index = torch.randperm(total)[: k * rows].view(k, rows)
    coefficients = (
        torch.rand(total),
        torch.full((total,), 0.95),
        torch.rand(total),
        torch.full((total,), 1e-8),
    )
    flags = None if primary is None else torch.tensor(primary).view(-1, 1)
    expected_sums, sums = torch.zeros(total), torch.zeros(total)
    expected = owner_row_factors(squares, index, coefficients, flags, expected_sums)
    got = triton_elementwise.row_factors_triton(squares, index, *coefficients, flags, sums)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert torch.equal(sums, expected_sums)  # the reported sums are the squares themselves


def _pieces(dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Pieces of several sizes (one empty, one over many blocks) in the given dtypes."""
    sizes = [4097, 0, 1, 3 * 4096 + 5, 700]
    return [torch.randn(n).to(dtype) for n, dtype in zip(sizes, dtypes * 5, strict=False)]


@pytest.mark.parametrize("mix", [0.95, None])
def test_many_momentum_inputs_in_one_launch_match_one_per_piece(mix: float | None) -> None:
    """A launch over an address table (pieces of several sizes and output dtypes, one
    masked) writes what one launch per piece writes, momenta and outputs bitwise."""
    torch.manual_seed(3)
    grads = _pieces([torch.float32])
    keeps = [torch.tensor(i != 3) for i in range(len(grads))]
    outs = [
        torch.empty(g.shape, dtype=d)
        for g, d in zip(grads, [torch.float32, torch.bfloat16] * 3, strict=False)
    ]
    momenta = [torch.randn(g.shape) for g in grads]
    expected_momenta = [m.clone() for m in momenta]
    expected_outs = [torch.empty_like(o) for o in outs]
    for args in zip(grads, expected_momenta, expected_outs, keeps, strict=True):
        triton_elementwise.momentum_input_triton(*args[:3], 0.9, mix, True, args[3])
    triton_elementwise.momentum_inputs_triton(grads, momenta, outs, 0.9, mix, True, keeps)
    for got, want in zip(momenta + outs, expected_momenta + expected_outs, strict=True):
        assert torch.equal(got, want)


def test_many_writes_in_one_launch_match_one_per_piece() -> None:
    """A launch over an address table (several sizes, parameter dtypes, Dion2 feedback on
    some pieces, one masked) writes what one launch per piece writes, bitwise."""
    torch.manual_seed(4)
    params = _pieces([torch.float32, torch.bfloat16])
    updates = [torch.randn(p.shape) for p in params]
    updates[0][::3] = -0.0
    updates[0][1::3] = 0.0
    momenta = [torch.randn(p.shape) for p in params]
    scalars = [
        (torch.tensor(0.99 - i / 100), torch.tensor(-0.01 * (i + 1)), torch.tensor(i != 2))
        for i in range(len(params))
    ]
    expected = [(p.clone(), m.clone()) for p, m in zip(params, momenta, strict=True)]
    feedback = [i % 2 == 0 for i in range(len(params))]
    for (p, m), u, (d, s, k), f in zip(expected, updates, scalars, feedback, strict=True):
        triton_elementwise.decay_and_update_triton(p, u, d, s, k, (m, 0.9) if f else None)
    triton_elementwise.decay_and_updates_triton(
        params,
        updates,
        *(list(column) for column in zip(*scalars, strict=True)),
        [(m, 0.9) if f else None for m, f in zip(momenta, feedback, strict=True)],
    )
    for p, m, (want_p, want_m) in zip(params, momenta, expected, strict=True):
        assert torch.equal(p, want_p) and torch.equal(m, want_m)


@pytest.mark.parametrize("shape", [(5, 30, 70), (3, 70, 100)], ids=str)
def test_dropped_matrices_zeroed_as_masked_fill(shape: tuple[int, int, int]) -> None:
    """The fused mask zeroes the dropped matrices (NaN included) across several blocks and
    leaves the kept ones bitwise as they were, as ``masked_fill_`` does."""
    stack = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    stack[0, 0, 0] = float("nan")
    stack[1, 0, 0] = float("nan")
    dropped = (torch.arange(shape[0]) % 2 == 0).logical_and_(torch.arange(shape[0]) < 4)
    expected = stack.clone().masked_fill_(dropped.view(-1, 1, 1), 0.0)
    triton_elementwise.zero_dropped_triton(stack, dropped)
    assert torch.equal(stack.isnan(), expected.isnan())
    assert torch.equal(stack.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("fused", [False, True])
def test_matrix_sums_flag_the_non_finite_matrices(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer's finiteness sums, into its buffer's slice: torch's sums bitwise where
    the fused form is not chosen (always on CPU), the Triton reduction's within fp32
    rounding where it is; non-finite exactly for the matrices with a non-finite entry."""
    monkeypatch.setattr(ops, "fused_form", lambda backend, *tensors: fused)
    stack = torch.randn(4, 30, 70, generator=torch.Generator().manual_seed(5)).bfloat16()
    stack[1, 3, 4] = float("inf")
    stack[2, 29, 69] = float("nan")
    expected = torch.sum(stack, dim=(-2, -1), dtype=torch.float32)
    sums = torch.full((6,), -1.0)
    matrix_sums(stack, sums[1:5], "triton")
    if fused:
        torch.testing.assert_close(sums[1:5], expected, rtol=0, atol=1e-3, equal_nan=True)
    else:
        assert torch.equal(sums[1:5].nan_to_num(), expected.nan_to_num())
    assert torch.equal(sums[1:5].isfinite(), torch.tensor([True, False, False, True]))
    assert sums[0].item() == sums[5].item() == -1.0


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place, for two
    roundings of one value (entries of one sign, whose bit patterns as integers are in the
    order of their values)."""
    assert a.dtype == b.dtype == torch.bfloat16
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mix", [0.95, None])
@pytest.mark.parametrize("store", [True, False])
def test_bf16_momentum_read_computes_in_fp32_and_mixes_the_stored_momentum(
    shape: tuple[int, ...], mix: float | None, store: bool
) -> None:
    """fp32 gradient, bf16 momentum: the fused read advances ``g + β·m`` in fp32 and rounds
    it once to bf16 (within an ulp of the nearest bf16: the interpreter truncates), stores
    it where ``store``, and mixes Newton–Schulz's input from that rounded value; the torch
    form rounds to nearest, exactly."""
    gen = torch.Generator().manual_seed(6)
    grad = torch.randn(shape, generator=gen)
    momentum = torch.randn(shape, generator=gen).bfloat16()
    exact = torch.add(grad, momentum.float(), alpha=0.9)  # fp32, never rounded to bf16
    nearest = exact.bfloat16()
    rule = {"beta": 0.9, "mix": mix, "keeps": [torch.tensor(True)], "store": store}
    for fused in (False, True):
        stored, out = momentum.clone(), torch.empty(shape)
        pre_orthogonalize_([grad], [stored], [out], **rule, fused=fused)
        if not store:
            assert torch.equal(stored, momentum), "store=False must leave the momentum alone"
            continue
        assert stored.dtype == torch.bfloat16
        if fused:
            assert _ulps(stored, nearest) <= 1
        else:
            assert torch.equal(stored, nearest)
        read = stored.float()
        torch.testing.assert_close(out, read if mix is None else grad + mix * read)
        unrounded = exact if mix is None else grad + mix * exact
        assert (out - unrounded).abs().max() > 1e-3, "the mix must read the rounded momentum"


def test_bf16_and_fp32_momenta_in_one_call_match_one_launch_per_piece() -> None:
    """An address-table launch over pieces whose momenta are bf16 and fp32 (one launch per
    dtype pair) writes what one launch per piece writes, bitwise, reads and Dion2's
    write alike."""
    torch.manual_seed(7)
    grads = _pieces([torch.float32])
    momenta = _pieces([torch.bfloat16, torch.float32])
    keeps = [torch.tensor(i != 3) for i in range(len(grads))]
    outs = [torch.empty(g.shape, dtype=torch.bfloat16) for g in grads]
    expected_momenta = [m.clone() for m in momenta]
    expected_outs = [torch.empty_like(o) for o in outs]
    for args in zip(grads, expected_momenta, expected_outs, keeps, strict=True):
        triton_elementwise.momentum_input_triton(*args[:3], 0.9, 0.95, True, args[3])
    triton_elementwise.momentum_inputs_triton(grads, momenta, outs, 0.9, 0.95, True, keeps)
    for got, want in zip(momenta + outs, expected_momenta + expected_outs, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)

    params = _pieces([torch.float32])
    updates = [torch.randn(p.shape).bfloat16() for p in params]
    scalars = [(torch.tensor(0.99), torch.tensor(-0.01), k) for k in keeps]
    expected = [(p.clone(), m.clone()) for p, m in zip(params, momenta, strict=True)]
    for (p, m), u, (d, s, k) in zip(expected, updates, scalars, strict=True):
        triton_elementwise.decay_and_update_triton(p, u, d, s, k, (m, 0.9))
    triton_elementwise.decay_and_updates_triton(
        params,
        updates,
        *(list(column) for column in zip(*scalars, strict=True)),
        [(m, 0.9) for m in momenta],
    )
    for p, m, (want_p, want_m) in zip(params, momenta, expected, strict=True):
        assert torch.equal(p, want_p) and m.dtype == want_m.dtype and torch.equal(m, want_m)


@pytest.mark.parametrize("keep", [True, False])
def test_error_feedback_on_a_bf16_momentum(keep: bool) -> None:
    """Dion2's feedback on a bf16 momentum, fused write and torch form: the same entries
    decay (the selected slices, only when kept), each to ``β·m`` in fp32 rounded once to
    bf16 (to nearest in torch, within an ulp fused), the others bitwise unchanged."""
    gen = torch.Generator().manual_seed(8)
    update = torch.randn(6, 700, generator=gen).bfloat16()
    update[1] = 0.0
    update[2, ::3] = -0.0
    momentum = torch.randn(6, 700, generator=gen).bfloat16()
    selected = ((update != 0) | torch.signbit(update)) & keep
    nearest = torch.where(selected, (momentum.float() * 0.9).bfloat16(), momentum)
    scalars = {
        "decay": torch.tensor(0.998 if keep else 1.0),
        "step": torch.tensor(-0.02 if keep else 0.0),
        "keep": torch.tensor(keep),
    }
    for fused in (False, True):
        m = momentum.clone()
        post_orthogonalize_(torch.randn(6, 700), update, **scalars, fused=fused, feedback=(m, 0.9))
        assert torch.equal(m[~selected], momentum[~selected])
        if fused:
            assert _ulps(m, nearest) <= 1
        else:
            assert torch.equal(m, nearest)


def test_strided_pieces_take_the_fused_passes_through_contiguous_copies() -> None:
    """Pieces cut across a shard's rows, and their regions in a stack, are strided: the
    many-piece passes read them through contiguous copies and write the results back, so
    they equal the torch form; the contiguous pieces beside them are untouched by that."""
    torch.manual_seed(7)
    shard, momentum = torch.randn(6, 40), torch.randn(6, 40)
    grads = [shard[:, :24], shard[:, 24:]]  # column pieces: strided
    stack = torch.zeros(2, 6, 40)  # fp32: the interpreter rounds to bf16 toward zero
    outs = [stack[0, :, :24], stack[1, :, 24:]]
    keeps = [torch.tensor(True), torch.tensor(True)]
    expected_momentum, expected_stack = momentum.clone(), stack.clone()
    rule = {"beta": 0.9, "mix": 0.95, "store": True}
    expected_outs = [expected_stack[0, :, :24], expected_stack[1, :, 24:]]
    pieces = [expected_momentum[:, :24], expected_momentum[:, 24:]]
    pre_orthogonalize_(grads, pieces, expected_outs, keeps=keeps, **rule, fused=False)
    pieces = [momentum[:, :24], momentum[:, 24:]]
    pre_orthogonalize_(grads, pieces, outs, keeps=keeps, **rule, fused=True)
    torch.testing.assert_close(momentum, expected_momentum)
    torch.testing.assert_close(stack, expected_stack)

    param, update = torch.randn(6, 40), torch.randn(2, 40, 6).bfloat16()
    expected = param.clone()
    targets, updates = [param[:, :24], param[:, 24:]], [update[0, :24].T, update[1, 24:].T]
    scalars = {"decay": torch.tensor(0.998), "step": torch.tensor(-0.02)}
    for target, piece, keep in zip(
        [expected[:, :24], expected[:, 24:]], updates, keeps, strict=True
    ):
        post_orthogonalize_(target, piece, **scalars, keep=keep, fused=False)
    ops.fused_updates_(
        targets,
        updates,
        decays=[scalars["decay"]] * 2,
        steps=[scalars["step"]] * 2,
        keeps=keeps,
        feedbacks=[None, None],
    )
    torch.testing.assert_close(param, expected)


# Sizes around the kernel's 256-entry blocks (224 and 300 tensors), and one of each.
@pytest.mark.parametrize(
    "sizes", [(1, 1, 1, 1, 1), (224, 224, 2, 3, 224), (300, 517, 5, 9, 1200)], ids=str
)
@pytest.mark.parametrize("found_inf", [0.0, 1.0])
@pytest.mark.parametrize("drop", [True, False])
def test_step_scalars_in_one_launch_equal_the_torch_form_bitwise(
    sizes: tuple[int, int, int, int, int], found_inf: float, drop: bool
) -> None:
    sources, layout, expected, fused = both_forms(sizes, found_inf, drop=drop, seed=sum(sizes))
    assert_bitwise_equal(expected, fused)
    if not drop:
        assert fused.dropped.all(), "drop=False leaves the dropped marks alone"
    assert bool(fused.ok) == (found_inf == 0.0)
    unkept = ~sources["keep"][layout.piece_tensor]
    assert (fused.step[unkept] == 0).all(), "an unkept tensor's pieces take no step"
