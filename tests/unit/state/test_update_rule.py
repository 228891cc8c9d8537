"""Every form of the update rule against its single-matrix reference, ``muon_update_``.

The step composes the batched forms in a few ways (momentum advanced before the read or in
it, in a span of the flat buffer or per tensor; decay over the whole tensor or in the write;
a class's shared step or a piece's own; cautious decay, Magma); each composition is run
here on one fp32 matrix and compared with the reference. The reference itself is checked
against the independent ``tests/support/reference_muon.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composed_rules import muon_update_
from reference_muon import reference_muon_step

from muon_dist.kernels import newton_schulz
from muon_dist.kernels.availability import interpret_mode
from muon_dist.rules.dion2_slices import add_slice_norms_, slice_norms
from muon_dist.rules.normuon_rows import scale_rows_
from muon_dist.rules.ops import (
    decay_,
    decay_factor,
    decay_rate,
    error_feedback_,
    magma_damping,
    magma_score_,
    magma_sums,
    mask_stack_,
    nesterov_mix,
    ns_inputs_,
    post_orthogonalize_,
    pre_orthogonalize_,
    shared_step_updates_,
    step_size,
    updates_,
)
from muon_dist.rules.scale import lr_scale
from muon_dist.state.flat import spans, zeros_like_flat
from muon_dist.state.muon_state import store_momenta_

LR, WD, BETA = 0.02, 0.1, 0.9
EXACT = {"rtol": 1e-6, "atol": 1e-7}


def _orthogonalize(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=5, dtype=torch.float32, backend="torch")


def _inputs(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


def _reference(
    shape: tuple[int, int], keep: bool, **options: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    param, grad, momentum = _inputs(shape)
    score = torch.full((1,), 0.7) if options.pop("magma", False) else None
    muon_update_(
        param,
        grad,
        momentum,
        _orthogonalize,
        lr=torch.tensor(LR),
        weight_decay=torch.tensor(WD),
        beta=BETA,
        scale=lr_scale(*shape, "spectral_norm"),
        keep=torch.tensor(keep),
        magma_score=score,
        **options,
    )
    return param, momentum, score


def _scalars(shape: tuple[int, int], keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay rate and step as the step derives them on the device."""
    kept = keep.float()
    rate = decay_rate(torch.tensor(LR), torch.tensor(WD), kept)
    neg_scale = torch.tensor(-lr_scale(*shape, "spectral_norm"))
    return rate, step_size(torch.tensor(LR), kept, neg_scale)


def _nesterov(nesterov: bool) -> float | None:
    return nesterov_mix(BETA, nesterov)


def _read_after_advance(
    grad: torch.Tensor, momentum: torch.Tensor, keep: torch.Tensor, nesterov: bool, span: bool
) -> torch.Tensor:
    """Momentum advanced before the read (per tensor, or in a span of a flat buffer)."""
    if span:
        flat = zeros_like_flat([momentum, momentum])
        flat[0].copy_(momentum)
        (run,) = spans(flat)
        views = [t.view(-1) for t in flat]
        store_momenta_([grad.view(-1), torch.zeros_like(grad).view(-1)], views, BETA, keep, run)
        momentum.copy_(flat[0])
    else:
        store_momenta_([grad], [momentum], BETA, keep)
    out = torch.empty_like(grad)
    ns_inputs_([grad], [momentum], [out], _nesterov(nesterov))
    return out


def _read_advancing(
    grad: torch.Tensor, momentum: torch.Tensor, keep: torch.Tensor, nesterov: bool, fused: bool
) -> torch.Tensor:
    out = torch.empty_like(grad)
    pre_orthogonalize_(
        [grad],
        [momentum],
        [out],
        beta=BETA,
        mix=_nesterov(nesterov),
        keeps=[keep],
        store=True,
        fused=fused,
    )
    return out


def _write(
    form: str,
    param: torch.Tensor,
    ortho: torch.Tensor,
    keep: torch.Tensor,
    rate: torch.Tensor,
    step: torch.Tensor,
) -> None:
    """One of the step's writes: whole-tensor decay then the piece's own step (``own``) or
    its class's shared step (``class``), or decay in the write (``in_write``, ``fused``)."""
    if form == "own":
        decay_([param], [decay_factor(rate)])
        updates_([param], [ortho], [step])
    elif form == "class":
        decay_([param], decay_factor(rate))
        scratch = torch.empty(param.numel())
        shared_step_updates_([param], [ortho], step, scratch, [scratch.view(param.shape)], keep)
    else:
        post_orthogonalize_(
            param, ortho, step=step, keep=keep, decay=decay_factor(rate), fused=form == "fused"
        )


@pytest.mark.parametrize("shape", [(12, 8), (8, 20)], ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize(
    "read, write",
    [("per_tensor", "own"), ("span", "class"), ("advancing", "in_write"), ("span", "in_write")],
)
def test_batched_forms_match_the_reference(
    shape: tuple[int, int], nesterov: bool, keep: bool, read: str, write: str
) -> None:
    expected, expected_momentum, _ = _reference(shape, keep, nesterov=nesterov)
    param, grad, momentum = _inputs(shape)
    kept = torch.tensor(keep)
    if read == "advancing":
        stack = _read_advancing(grad, momentum, kept, nesterov, fused=False)
    else:
        stack = _read_after_advance(grad, momentum, kept, nesterov, span=read == "span")
    mask_stack_(stack.unsqueeze(0), kept.logical_not().view(1))
    rate, step = _scalars(shape, kept)
    _write(write, param, _orthogonalize(stack), kept, rate, step)
    torch.testing.assert_close(momentum, expected_momentum, rtol=0, atol=0)
    torch.testing.assert_close(param, expected, **EXACT)
    if not keep:
        assert torch.equal(param, _inputs(shape)[0])


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("magma", [True, False])
@pytest.mark.parametrize("cautious", [True, False])
def test_cautious_and_magma_writes_match_the_reference(
    keep: bool, magma: bool, cautious: bool
) -> None:
    """Pieces under Magma or cautious decay: momentum first, the score from its sums, then
    a one-by-one write with a per-row step (Magma) and the cautious rate."""
    shape = (10, 6)
    expected, expected_momentum, expected_score = _reference(
        shape, keep, nesterov=True, magma=magma, cautious=cautious
    )
    param, grad, momentum = _inputs(shape)
    kept = torch.tensor(keep)
    stack = _read_after_advance(grad, momentum, kept, nesterov=True, span=False)
    mask_stack_(stack.unsqueeze(0), kept.logical_not().view(1))
    rate, step = _scalars(shape, kept)
    score = torch.full((1,), 0.7)
    if magma:
        total = torch.zeros(3, 1).index_add_(
            1, torch.zeros(shape[0], dtype=torch.long), magma_sums(momentum, grad)
        )
        magma_score_(score, *total, beta=0.9, keep=kept)
        step = (magma_damping(score)[torch.zeros(shape[0], dtype=torch.long)] * step).view(-1, 1)
    decay = None if cautious else decay_factor(rate)
    cautious_rate = rate if cautious else None
    post_orthogonalize_(
        param, _orthogonalize(stack), step=step, keep=kept, decay=decay, cautious=cautious_rate
    )
    torch.testing.assert_close(momentum, expected_momentum, rtol=0, atol=0)
    torch.testing.assert_close(param, expected, **EXACT)
    if magma:
        assert expected_score is not None
        torch.testing.assert_close(score, expected_score, **EXACT)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32_grads", "fp32_and_bf16_grads"])
def test_bf16_momenta_in_a_span_store_as_per_tensor(keep: bool, mixed: bool) -> None:
    """``momentum_dtype="bf16"``: a group's bf16 momenta in one flat buffer (padding
    between the views), advanced from fp32 gradients, or from fp32 and bf16 ones (a group
    of mixed parameters). The span form stores bitwise what the per-tensor form stores:
    ``g + β·m`` in the wider of the two dtypes rounded to the nearest bf16 (one rounding
    from fp32 gradients), and nothing where not kept."""
    shapes = [(5, 7), (3, 3), (11,)]
    gen = torch.Generator().manual_seed(4)
    momenta = zeros_like_flat([torch.empty(s) for s in shapes], [torch.bfloat16] * len(shapes))
    for m in momenta:
        m.copy_(torch.randn(m.shape, generator=gen))
    dtypes = [torch.float32, torch.bfloat16 if mixed else torch.float32, torch.float32]
    grads = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    kept = torch.tensor(keep)
    before = [m.clone() for m in momenta]
    per_tensor = [m.clone() for m in momenta]
    store_momenta_(grads, per_tensor, BETA, kept)
    (run,) = spans(momenta)
    store_momenta_([g.view(-1) for g in grads], [m.view(-1) for m in momenta], BETA, kept, run)
    for got, alone, old, grad in zip(momenta, per_tensor, before, grads, strict=True):
        want = torch.add(grad, old, alpha=BETA).bfloat16() if keep else old
        assert got.dtype == alone.dtype == torch.bfloat16
        assert torch.equal(got, want) and torch.equal(alone, want)


@pytest.mark.skipif(
    not interpret_mode(), reason="the fused form runs on CPU in Triton's interpreter"
)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_fused_form_matches_the_reference(nesterov: bool, keep: bool) -> None:
    pytest.importorskip("triton")
    shape = (12, 8)
    expected, expected_momentum, _ = _reference(shape, keep, nesterov=nesterov)
    param, grad, momentum = _inputs(shape)
    kept = torch.tensor(keep)
    stack = _read_advancing(grad, momentum, kept, nesterov, fused=True)
    rate, step = _scalars(shape, kept)
    _write("fused", param, _orthogonalize(stack), kept, rate, step)
    torch.testing.assert_close(momentum, expected_momentum, **EXACT)
    torch.testing.assert_close(param, expected, **EXACT)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("options", [{}, {"cautious": True}, {"magma": True}], ids=str)
def test_the_reference_matches_the_independent_test_reference(
    nesterov: bool, options: dict[str, Any]
) -> None:
    """``muon_update_`` against ``tests/support/reference_muon.py``, written from the algorithm."""
    shape = (12, 8)
    got, got_momentum, got_score = _reference(shape, True, nesterov=nesterov, **options)
    param, grad, momentum = _inputs(shape)
    score = torch.full((1,), 0.7) if options.get("magma") else None
    reference_muon_step(
        param,
        grad,
        momentum,
        lr=LR,
        momentum=BETA,
        nesterov=nesterov,
        weight_decay=WD,
        ns_dtype=torch.float32,
        magma_score=score,
        cautious_wd=bool(options.get("cautious")),
    )
    torch.testing.assert_close(got_momentum, momentum, **EXACT)
    torch.testing.assert_close(got, param, rtol=1e-5, atol=1e-6)
    if score is not None:
        assert got_score is not None
        torch.testing.assert_close(got_score, score, **EXACT)


@pytest.mark.skipif(
    not interpret_mode(), reason="the fused form runs on CPU in Triton's interpreter"
)
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_fused_row_scaling_matches_the_torch_form(columns: bool) -> None:
    """NorMuon's in-place row scaling: the Triton pass equals torch's broadcast multiply
    bitwise (fp32, the interpreter's exact dtype), on rows and on columns."""
    pytest.importorskip("triton")
    from muon_dist.kernels.triton_elementwise import scale_rows_triton

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 37, 53, generator=generator)
    factors = torch.rand(3, 53 if columns else 37, generator=generator)
    expected = x.clone()
    scale_rows_(expected, factors, columns=columns)
    scale_rows_triton(x, factors, columns)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_row_scaling_of_a_transposed_view_scales_its_rows() -> None:
    """A view whose transpose is contiguous (Newton–Schulz's tall results) is scaled
    through that transpose: the same values as scaling the view's rows directly."""
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(2, 40, 24, generator=generator)
    factors = torch.rand(2, 24, generator=generator)
    view = base.clone().mT  # [2, 24, 40], rows are base's columns
    expected = view.contiguous() * factors.unsqueeze(-1)
    scale_rows_(view, factors)
    torch.testing.assert_close(view, expected, rtol=0, atol=0)


@pytest.mark.skipif(
    not interpret_mode(), reason="the fused form runs on CPU in Triton's interpreter"
)
@pytest.mark.parametrize("axis", [-2, -1], ids=["rows", "columns"])
def test_fused_slice_norms_match_the_torch_form(axis: int) -> None:
    """Dion2's float64 L1 norms of a strided stack: the Triton pass equals torch's sum."""
    pytest.importorskip("triton")
    from muon_dist.kernels.triton_elementwise import slice_l1_triton

    x = torch.randn(3, 70, 37, generator=torch.Generator().manual_seed(6)).mT  # strided
    expected = slice_norms(x, axis)
    torch.testing.assert_close(slice_l1_triton(x, axis), expected, rtol=1e-15, atol=0)


@pytest.mark.skipif(
    not interpret_mode(), reason="the fused form runs on CPU in Triton's interpreter"
)
@pytest.mark.parametrize("keep", [True, False])
def test_fused_error_feedback_matches_the_torch_form(keep: bool) -> None:
    """Selected entries (nonzero, or a negative zero) decay; positive zeros do not."""
    pytest.importorskip("triton")
    from muon_dist.kernels.triton_elementwise import error_feedback_triton

    generator = torch.Generator().manual_seed(7)
    update = torch.randn(6, 50, generator=generator)
    update[1] = 0.0
    update[2] = -0.0
    update[3, ::2] = -0.0
    momentum = torch.randn(6, 50, generator=generator)
    expected = momentum.clone()
    error_feedback_(expected, update, 0.9, torch.tensor(keep))
    error_feedback_triton(momentum, update, 0.9, torch.tensor(keep))
    torch.testing.assert_close(momentum, expected, rtol=0, atol=0)


@pytest.mark.skipif(
    not interpret_mode(), reason="the fused form runs on CPU in Triton's interpreter"
)
@pytest.mark.parametrize("axis", [-2, -1], ids=["rows", "columns"])
def test_fused_slice_norms_add_at_their_slots(axis: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial norms of several tensors (each layout of strides, one empty) added at slots
    they share, in one pass, each slice split over several programs: the Triton pass's
    atomic adds equal torch's ``index_add_``."""
    pytest.importorskip("triton")
    from muon_dist.kernels import triton_elementwise
    from muon_dist.kernels.triton_elementwise import add_slice_l1_triton

    monkeypatch.setattr(triton_elementwise, "_SLICE_CHUNK", 64)  # slices of 70 and 150
    generator = torch.Generator().manual_seed(8)
    xs = [
        torch.randn(2, 150, 70, generator=generator).mT,  # [2, 70, 150], strided
        torch.randn(3, 70, 150, generator=generator),
        torch.randn(2, 140, 300, generator=generator)[:, ::2, ::2],  # no stride of 1
        torch.zeros(0, 70, 150),
    ]
    count = xs[0].shape[axis]
    shared = torch.randperm(200, generator=generator)[:count]
    slots = [shared.expand(x.shape[0], count).contiguous() for x in xs]
    expected = torch.rand(200, dtype=torch.float64, generator=generator)
    norms = expected.clone()
    add_slice_norms_(expected, xs, [axis] * 4, slots)
    add_slice_l1_triton(norms, xs, [axis] * 4, slots)
    torch.testing.assert_close(norms, expected, rtol=1e-15, atol=0)
