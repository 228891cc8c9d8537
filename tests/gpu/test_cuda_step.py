"""The step on CUDA devices: no host sync in steady state, and a captured step equals the
eager one, on one GPU and on FSDP2 with real backward passes over two (`pytest -m gpu`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_step_cases import LR as FSDP_LR
from cuda_step_cases import fsdp_capture_worker
from dist_harness import pool
from torch import nn

import muon_dist

LR = 0.02


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # (2048, 1024) is large enough for the fused passes, the rest take the torch form.
    shapes = [(2048, 1024), (96, 64), (64, 200), (4, 48, 32), (64,)]
    return [nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]


def _groups(params: list[nn.Parameter], **options: Any) -> list[dict[str, Any]]:
    return [
        {"params": params[:2], "algorithm": "muon", "weight_decay": 0.1, **options},
        {"params": params[2:3], "algorithm": "muon", "cautious_wd": True},
        {"params": params[3:4], "algorithm": "muon", "experts": True, "magma": True},
        {"params": params[4:], "algorithm": "adamw", "weight_decay": 0.01},
    ]


def _grads(step: int, params: list[nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    return [torch.randn(p.shape, device="cuda", generator=gen) for p in params]


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_steady_state_step_never_syncs(nonfinite: str) -> None:
    params = _params(0)
    opt = muon_dist.Muon(_groups(params), lr=LR, nonfinite=nonfinite)
    scheduler = _schedule(opt)
    for p, g in zip(params, _grads(0, params), strict=True):
        p.grad = g
    for _ in range(2):  # warm-up: Triton autotuning and first-use allocations sync
        opt.step()
        scheduler.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step()
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.check_finite()


def _run(
    params: list[nn.Parameter], opt: torch.optim.Optimizer, steps: range
) -> list[list[torch.Tensor]]:
    scheduler = _schedule(opt)
    for _ in range(steps.start):
        scheduler.step()
    history = []
    for step in steps:
        for p, g in zip(params, _grads(step, params), strict=True):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)  # gradients kept in place, as zero_grad(set_to_none=False)
        opt.step()
        scheduler.step()
        history.append([p.detach().clone() for p in params])
    return history


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    # Newton–Schulz runs in bf16: a different tile order would round within 2 lr·2⁻⁸.
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=2 * LR * 2**-8)


def test_captured_step_matches_eager_under_an_lr_schedule() -> None:
    eager_params, graph_params = _params(1), _params(1)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR)
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph=True)
    steps = range(6)
    expected = _run(eager_params, eager, steps)
    got = _run(graph_params, graphed, steps)
    assert graphed.runner.graph is not None and graphed.runner.graph.captured
    for a, b in zip(expected, got, strict=True):
        _close(a, b)


def test_captured_step_resumes_from_a_state_dict() -> None:
    params = _params(2)
    opt = muon_dist.Muon(_groups(params), lr=LR, cuda_graph=True)
    _run(params, opt, range(4))
    saved_params = [p.detach().clone() for p in params]
    saved = opt.state_dict()
    saved = {
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in saved["state"].items()},
        "param_groups": saved["param_groups"],
    }
    continued = _run(params, opt, range(4, 7))
    resumed_params = [nn.Parameter(t) for t in saved_params]
    resumed = muon_dist.Muon(_groups(resumed_params), lr=LR, cuda_graph=True)
    resumed.load_state_dict(saved)
    _close(continued[-1], _run(resumed_params, resumed, range(4, 7))[-1])


def test_captured_step_refuses_moved_gradients_and_skips_nonfinite() -> None:
    params = _params(3)
    opt = muon_dist.Muon(_groups(params), lr=LR, cuda_graph=True)
    _run(params, opt, range(4))
    before = [p.detach().clone() for p in params]
    params[1].grad[0, 0] = float("nan")  # in place: the captured step reads it
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    with pytest.raises(FloatingPointError, match=r"step 5: non-finite gradient in"):
        opt.check_finite()
    opt.zero_grad(set_to_none=True)
    for p, g in zip(params, _grads(9, params), strict=True):
        p.grad = g
    with pytest.raises(RuntimeError, match=r"zero_grad\(set_to_none=False\)"):
        opt.step()


def test_fsdp2_captured_step_matches_eager_without_host_syncs() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    for result in pool(2, "nccl").run(fsdp_capture_worker, timeout=600):
        assert result["captured"], "the cuda_graph=True optimizer never captured its step"
        assert result["syncs"] == [], result["syncs"]
        assert result["worst"] <= 2 * FSDP_LR * 2**-8, result
