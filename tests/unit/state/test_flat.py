"""Momentum buffers laid out in one flat buffer, and the single-select store built on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.state.flat import ALIGN_BYTES, spans, zeros_like_flat
from muon_dist.state.muon_state import store_momenta_

SHAPES = [(5, 3), (0, 4), (7,), (2, 3, 4), (1, 1)]


def test_zeros_like_flat_shares_one_aligned_buffer_per_dtype() -> None:
    params = [torch.randn(s, dtype=d) for s in SHAPES for d in (torch.float32, torch.bfloat16)]
    zeros = zeros_like_flat(params)
    for p, z in zip(params, zeros, strict=True):
        assert z.shape == p.shape and z.dtype == p.dtype and not z.any()
        assert z.data_ptr() % ALIGN_BYTES == 0 or z.numel() == 0
    for dtype in (torch.float32, torch.bfloat16):
        storages = {z.untyped_storage().data_ptr() for z in zeros if z.dtype == dtype}
        assert len(storages) == 1
    # A write to one view touches no other parameter's zeros.
    zeros[0].fill_(1.0)
    assert all(not z.any() for z in zeros[1:])


def test_spans_cover_runs_of_one_buffer_and_split_into_the_members() -> None:
    zeros = zeros_like_flat([torch.empty(s) for s in SHAPES])
    loose = torch.zeros(3)
    tensors = [*zeros[:3], loose, *zeros[3:]]
    found = spans(tensors)
    assert [s.members for s in found] == [(0, 1, 2), (3,), (4, 5)]
    for span in found:
        if span.flat is None:
            continue
        views = span.split(span.flat)
        for index, view in zip(span.members, views, strict=True):
            assert view.data_ptr() == tensors[index].data_ptr() or view.numel() == 0
            assert view.numel() == tensors[index].numel()
    assert spans([torch.zeros(2), torch.zeros(2)])[0].flat is None  # separate allocations


@pytest.mark.parametrize("keep", [True, False])
def test_span_store_matches_the_per_tensor_store_bitwise(keep: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.empty(s) for s in SHAPES]
    momenta = zeros_like_flat(params)
    for m in momenta:
        m.copy_(torch.randn(m.shape, generator=gen))
    grads = [torch.randn(m.shape, generator=gen) for m in momenta]
    if not keep:
        grads[0].fill_(float("nan"))  # a skipped step's gradient may be anything
    expected = [m.clone() for m in momenta]
    flag = torch.tensor(keep)
    store_momenta_(grads, expected, 0.9, flag)
    (span,) = spans(momenta)
    store_momenta_([g.view(-1) for g in grads], [m.view(-1) for m in momenta], 0.9, flag, span)
    for got, want in zip(momenta, expected, strict=True):
        assert torch.equal(got, want)


def _muon_with_state(seed: int) -> tuple[muon_dist.Muon, list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 4), (4, 9), (5, 5)]]
    opt = muon_dist.Muon([{"params": params, "algorithm": "muon"}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt, params


def test_load_state_dict_keeps_the_momenta_in_their_buffer() -> None:
    """Loaded momenta are copied into the group's buffer, so the step keeps its one select."""
    saved, _ = _muon_with_state(0)
    opt, params = _muon_with_state(1)
    opt.load_state_dict(saved.state_dict())
    momenta = [opt.state[p]["momentum_buffer"] for p in params]
    assert len(spans(momenta)) == 1
    for p, q in zip(params, saved.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], saved.state[q]["momentum_buffer"])
