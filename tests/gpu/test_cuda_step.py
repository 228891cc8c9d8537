"""The step on CUDA devices: no host sync in steady state, and a captured step equals the
eager one, with gradients kept in place or freed by ``zero_grad()`` between steps, on one
GPU and on FSDP2 with real backward passes over one and two (`pytest -m gpu`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_step_cases import LR as FSDP_LR
from cuda_step_cases import fsdp_capture_worker
from dist_harness import pool
from torch import nn

import muon_dist
from muon_dist.step.bucket import orthogonalizer

LR = 0.02


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # The fused passes write the first group's pieces; cautious decay and Magma write
    # theirs one piece at a time.
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


@pytest.mark.parametrize("cuda_graph", [False, "auto"])
@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_steady_state_step_never_syncs(nonfinite: str, cuda_graph: bool | str) -> None:
    params = _params(0)
    opt = muon_dist.Muon(_groups(params), lr=LR, nonfinite=nonfinite, cuda_graph=cuda_graph)
    scheduler = _schedule(opt)
    for p, g in zip(params, _grads(0, params), strict=True):
        p.grad = g
    # Warm-up: Triton autotuning and first-use allocations sync, and so does the capture
    # (after graph_warmup=2 eager steps); the steps after it replay.
    for _ in range(3):
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
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    steps: range,
    set_to_none: bool | None = None,
    missing: tuple[int, int] | None = None,
) -> list[list[torch.Tensor]]:
    """Steps under an lr schedule. ``set_to_none`` None: gradients kept in place (copied
    into), else ``opt.zero_grad(set_to_none=...)`` after each step and new gradient tensors.
    ``missing`` (step, index): that parameter has no gradient in that step."""
    scheduler = _schedule(opt)
    for _ in range(steps.start):
        scheduler.step()
    history = []
    for step in steps:
        for index, (p, g) in enumerate(zip(params, _grads(step, params), strict=True)):
            if missing == (step, index):
                p.grad = None
            elif p.grad is None or set_to_none is not None:
                p.grad = g
            else:
                p.grad.copy_(g)  # gradients kept in place, as zero_grad(set_to_none=False)
        opt.step()
        scheduler.step()
        if set_to_none is not None:
            opt.zero_grad(set_to_none=set_to_none)
        history.append([p.detach().clone() for p in params])
    return history


def _equal(expected: list[list[torch.Tensor]], got: list[list[torch.Tensor]], what: str) -> None:
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            worst = (x - y).abs().max().item()
            assert torch.equal(x, y), f"{what}: step {step}, parameter {index}: differs by {worst}"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_captured_step_with_zero_grad_is_bitwise_the_eager_step(set_to_none: bool) -> None:
    """``cuda_graph="auto"`` captures on CUDA; with ``zero_grad()`` between steps
    (gradients freed, or zeroed in place and then replaced) each replay copies the new
    gradients into the captured ones, and every step equals the eager one bit for bit."""
    eager_params, graph_params = _params(4), _params(4)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR, cuda_graph=False)
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph="auto")
    steps = range(7)
    expected = _run(eager_params, eager, steps, set_to_none=set_to_none)
    got = _run(graph_params, graphed, steps, set_to_none=set_to_none)
    assert graphed.uncaptured_reason is None
    assert graphed.runner.graph is not None and graphed.runner.graph.captured
    _equal(expected, got, f"captured, zero_grad(set_to_none={set_to_none})")


def test_captured_step_runs_small_stacks_beside_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured step spreads its launch-bound stacks over its stream and side streams
    (branches of the graph), and still equals the eager step bit for bit."""
    uses: list[str] = []
    real = orthogonalizer.side_stream

    def spy(device: torch.device, use: str) -> torch.cuda.Stream:
        uses.append(use)
        return real(device, use)

    monkeypatch.setattr(orthogonalizer, "side_stream", spy)
    eager_params, graph_params = _params(5), _params(5)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR, cuda_graph=False)
    expected = _run(eager_params, eager, range(5), set_to_none=True)
    assert not uses  # an uncaptured step runs its stacks in order
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph=True)
    got = _run(graph_params, graphed, range(5), set_to_none=True)
    assert any(use.startswith("stacks beside") for use in uses)
    assert graphed.runner.graph is not None and graphed.runner.graph.captured
    _equal(expected, got, "captured, stacks beside each other")


def test_a_step_with_a_missing_gradient_runs_eagerly_between_replays() -> None:
    """A parameter without a gradient in one step after capture: that step runs uncaptured,
    as the eager step treats it, and the replays after it continue bitwise."""
    eager_params, graph_params = _params(5), _params(5)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR, cuda_graph=False)
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph=True)
    steps, missing = range(8), (5, 2)
    expected = _run(eager_params, eager, steps, set_to_none=True, missing=missing)
    got = _run(graph_params, graphed, steps, set_to_none=True, missing=missing)
    assert graphed.runner.graph is not None and graphed.runner.graph.captured
    _equal(expected, got, "captured with a missing gradient at step 5")


def test_replays_read_their_own_address_tables_while_another_step_runs_eagerly() -> None:
    """The fused kernels' address tables of a captured step are its own: another
    optimizer's eager steps between two replays (enough to go round the shared pinned
    buffers) must not rewrite them."""
    eager_params, graph_params, other_params = _params(6), _params(6), _params(7)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR, cuda_graph=False)
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph=True)
    other = muon_dist.Muon(_groups(other_params), lr=LR, cuda_graph=False)
    expected = _run(eager_params, eager, range(4), set_to_none=True)
    got = _run(graph_params, graphed, range(3), set_to_none=True)
    assert graphed.runner.graph is not None and graphed.runner.graph.captured
    _run(other_params, other, range(40), set_to_none=True)  # many tables through the ring
    got += _run(graph_params, graphed, range(3, 4), set_to_none=True)
    _equal(expected, got, "a replay after another optimizer's eager steps")


def test_replays_copy_no_address_table() -> None:
    """A captured step's address tables stay in device memory: its pinned buffers,
    overwritten after the capture, change no replay."""
    eager_params, graph_params = _params(8), _params(8)
    eager = muon_dist.Muon(_groups(eager_params), lr=LR, cuda_graph=False)
    graphed = muon_dist.Muon(_groups(graph_params), lr=LR, cuda_graph=True)
    expected = _run(eager_params, eager, range(5), set_to_none=True)
    got = _run(graph_params, graphed, range(3), set_to_none=True)
    graph = graphed.runner.graph
    assert graph is not None and graph.captured
    tables = graph._staging._tables
    assert tables
    for host, _ in tables:
        host.fill_(-1)
    got += _run(graph_params, graphed, range(3, 5), set_to_none=True)
    _equal(expected, got, "replays after the pinned tables were overwritten")


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


def test_captured_step_takes_moved_gradients_and_skips_nonfinite() -> None:
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
    opt.step()  # the moved gradients are copied into the captured ones
    opt.check_finite()
    assert not all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(("world", "set_to_none"), [(1, True), (2, False), (2, True)])
def test_fsdp2_captured_step_matches_eager_without_host_syncs(
    world: int, set_to_none: bool
) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    for result in pool(world, "nccl").run(fsdp_capture_worker, set_to_none, timeout=600):
        assert result["captured"], "the captured optimizer never captured its step"
        assert result["syncs"] == [], result["syncs"]
        assert result["worst"] <= 2 * FSDP_LR * 2**-8, result
