"""``momentum_dtype="bf16"`` on a CUDA GPU (`pytest -m gpu`), where the fused Triton passes
round fp32 to bf16 to nearest, as torch does (Triton's CPU interpreter truncates).

The fused read stores what the torch form stores, up to the rare entry whose fp32 sum the
two compute one bit apart (a fused multiply-add, or a multiply then an add) right at a bf16
rounding boundary, and mixes Newton–Schulz's input from the stored momentum; Dion2's fused
feedback rounds as torch's does, bitwise. The whole step with every pass fused
(``backend="triton"``) stays with the single-device reference whose momentum is rounded to
bf16 after each advance (``bf16_momentum_reference``) within ``FUSED`` (below), ``SEEN``
times closer than a reference keeping fp32 momenta, under Muon, NorMuon and Dion2; and its
captured step equals the eager one bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bf16_momentum_reference import Hyper, relative, step
from torch import nn

import muon_dist
from muon_dist.rules.ops import post_orthogonalize_, pre_orthogonalize_

SHAPES = [(256, 384), (384, 128), (200, 200)]
HYPER = Hyper()
STEPS = 4
# The fused step against the reference: fp32 Newton–Schulz rounding (the exact bound, 1e-5)
# plus the momentum entries the fused pass may round to the other bf16 neighbour (where its
# fp32 sum differs from torch's in the last bit right at a rounding boundary: a few in 10^6
# entries a step). Each moves its matrix's update by about 2^-8/sqrt(numel) of it, and with
# flips in proportion to numel their sum is about 2^-8·sqrt(rate·steps) ≈ 2e-5 at any
# size. The fp32-momentum reference is 2.3e-4 (Dion2) to 9.7e-4 (Muon) away at these shapes
# (measured against the bf16 one, CPU), so SEEN asks the bf16 one to be 4x closer.
FUSED = 5e-5
SEEN = 4


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 ulps of two roundings of one value (one sign)."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("mix", [0.95, None])
def test_fused_read_of_a_bf16_momentum_rounds_as_torch(mix: float | None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(3, 1000, 1001, device="cuda", generator=gen)
    momentum = torch.randn(grad.shape, device="cuda", generator=gen).bfloat16()
    keep = torch.ones((), dtype=torch.bool, device="cuda")
    rule = {"beta": 0.9, "mix": mix, "keeps": [keep], "store": True}
    stored = {}
    for fused in (False, True):
        m, out = momentum.clone(), torch.empty_like(grad)
        pre_orthogonalize_([grad], [m], [out], **rule, fused=fused)
        read = m.float()
        torch.testing.assert_close(out, read if mix is None else grad + mix * read)
        stored[fused] = m
    assert stored[True].dtype == torch.bfloat16
    assert _ulps(stored[True], stored[False]) <= 1
    flipped = (stored[True] != stored[False]).float().mean().item()
    assert flipped < 1e-4, f"{flipped:.1e} of the entries round to the other neighbour"


def test_fused_error_feedback_on_a_bf16_momentum_is_torchs() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    update = torch.randn(5, 777, 513, device="cuda", generator=gen).bfloat16()
    update[:, ::3] = 0.0
    update[:, 1::3, ::2] = -0.0
    momentum = torch.randn(update.shape, device="cuda", generator=gen).bfloat16()
    scalars = {
        "decay": torch.tensor(0.998, device="cuda"),
        "step": torch.tensor(-0.02, device="cuda"),
        "keep": torch.ones((), dtype=torch.bool, device="cuda"),
    }
    results = []
    for fused in (False, True):
        param, m = torch.zeros(update.shape, device="cuda"), momentum.clone()
        post_orthogonalize_(param, update, **scalars, fused=fused, feedback=(m, 0.95))
        results.append(m)
    assert torch.equal(results[0], results[1])


def _run(rule: str, **options: Any) -> tuple[list[torch.Tensor], list[nn.Parameter], Any]:
    gen = torch.Generator().manual_seed(2)
    starts = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
    params = [nn.Parameter(s.cuda()) for s in starts]
    opt = muon_dist.Muon(
        [(f"w{i}", p) for i, p in enumerate(params)],
        lr=HYPER.lr,
        momentum=HYPER.momentum,
        weight_decay=HYPER.weight_decay,
        rule=rule,
        momentum_dtype="bf16",
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        ns_method="standard",  # the reference's iteration ("auto" takes Gram's on CUDA)
        **options,
    )
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.cuda()
        opt.step()
    torch.cuda.synchronize()
    return starts, params, (opt, grads)


@pytest.mark.parametrize("rule", ["muon", "normuon", "dion2"])
def test_fused_bf16_momentum_steps_as_the_bf16_reference(rule: str) -> None:
    starts, params, (opt, grads) = _run(rule, backend="triton")
    table = opt.runner.muon.shard_io_table()
    assert "fused" in table, table
    for i, (p, start) in enumerate(zip(params, starts, strict=True)):
        assert opt.state[p]["momentum_buffer"].dtype == torch.bfloat16
        far = {}
        for store in (torch.bfloat16, torch.float32):  # the reference on the GPU too (float64)
            want = start.cuda()
            momentum = torch.zeros(SHAPES[i], dtype=store, device="cuda")
            moment = torch.zeros(SHAPES[i][0], device="cuda")
            for step_grads in grads:
                grad = step_grads[i].cuda()
                step(want, grad, momentum, HYPER, rule=rule, store=store, row_moment=moment)
            far[store] = relative(p.detach(), want, start.cuda())
        assert far[torch.bfloat16] <= FUSED, f"w{i}: {far}"
        assert far[torch.float32] >= SEEN * far[torch.bfloat16], f"w{i}: not seen: {far}"


def test_captured_bf16_momentum_step_is_bitwise_the_eager_one() -> None:
    _, eager, (eager_opt, _) = _run("muon", cuda_graph=False)
    _, captured, (captured_opt, _) = _run("muon", cuda_graph=True)
    for p, q in zip(eager, captured, strict=True):
        assert torch.equal(p, q)
        mine, theirs = (
            eager_opt.state[p]["momentum_buffer"],
            captured_opt.state[q]["momentum_buffer"],
        )
        assert theirs.dtype == torch.bfloat16 and torch.equal(mine, theirs)
