"""``cuda_graph="auto"`` (the default) on CPU: eager steps and one INFO line saying why;
:func:`capture_blocker`'s other reasons; a step with a missing gradient runs uncaptured;
the option's checks name the option, the value and the fix. The captured path itself is
tested on CUDA (tests/gpu/test_cuda_step.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.comm.groups import CommGroups, Peers
from muon_dist.options.settings import ExecutionSettings
from muon_dist.step.launch.cuda_graph import CaptureChoice, StepGraph, capture_blocker

SOLO = Peers((0,), None)
COMM = CommGroups(0, 1, SOLO, SOLO)
CUDA = torch.device("cuda")


def _capture_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "cuda_graph=" in r.getMessage()
    ]


def test_auto_on_cpu_runs_eagerly_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        opt = muon_dist.Muon(muon_dist.param_groups(model))
        for _ in range(3):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()  # set_to_none=True, as torch, the Trainer and accelerate call it
    assert opt.settings.cuda_graph == "auto"
    assert opt.runner.graph is None
    assert opt.uncaptured_reason is not None and "cpu" in opt.uncaptured_reason
    lines = _capture_lines(caplog)
    assert lines == [
        "muon_dist.Muon: cuda_graph='auto': the parameters are on cpu, and CUDA graphs "
        "capture CUDA work only; steps run eagerly"
    ]


def test_false_and_true_say_nothing_or_refuse_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    weight = nn.Parameter(torch.randn(8, 8))
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        opt = muon_dist.Muon([weight], cuda_graph=False)
    assert _capture_lines(caplog) == [] and opt.uncaptured_reason is None
    with pytest.raises(ValueError, match=r"cuda_graph=True captures CUDA work.*'auto' or False"):
        muon_dist.Muon([weight], cuda_graph=True)


@pytest.mark.parametrize(
    ("value", "error"),
    [("yes", ValueError), ("Auto", ValueError), (1, TypeError), (None, TypeError)],
)
def test_a_bad_cuda_graph_names_the_option_the_value_and_the_choices(
    value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=rf"Muon: cuda_graph={value!r} is not supported; choose 'auto'"):
        muon_dist.Muon([nn.Parameter(torch.randn(8, 8))], cuda_graph=value)


def test_auto_with_backward_overlap_is_allowed_and_true_refused() -> None:
    assert ExecutionSettings(overlap="backward", cuda_graph="auto").cuda_graph == "auto"
    with pytest.raises(
        ValueError, match=r"use cuda_graph='auto' \(the default: eager there\) or False"
    ):
        ExecutionSettings(overlap="backward", cuda_graph=True)


def test_capture_blocker_reasons() -> None:
    assert capture_blocker(ExecutionSettings(), CUDA, COMM) is None
    overlap = capture_blocker(ExecutionSettings(overlap="auto"), CUDA, COMM)
    assert overlap is not None and overlap.startswith("overlap='auto' starts Newton-Schulz")
    cpu = capture_blocker(ExecutionSettings(), torch.device("cpu"), COMM)
    assert cpu is not None and "cpu" in cpu


def test_auto_resolves_to_capture_on_cuda_without_touching_the_device() -> None:
    choice = CaptureChoice(ExecutionSettings(cuda_graph="auto"), CUDA, COMM)
    assert choice.settings.cuda_graph is True and choice.uncaptured_reason is None
    graph = StepGraph(2)
    choice.bind(graph)
    assert graph.fallback is not None
    graph.fallback("capturing the step failed (RuntimeError: boom)")
    assert choice.uncaptured_reason == "capturing the step failed (RuntimeError: boom)"
    forced = CaptureChoice(ExecutionSettings(cuda_graph=True), CUDA, COMM)
    forced_graph = StepGraph(2)
    forced.bind(forced_graph)
    assert forced_graph.fallback is None  # True: a failed capture raises


def test_a_step_with_a_missing_gradient_runs_uncaptured(caplog: pytest.LogCaptureFixture) -> None:
    """The runner runs such a step eagerly and says so once; the graph serves the others.
    (The CPU has no graph to replay: the graph's replay runs the step's body here.)"""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [muon_dist.Muon(muon_dist.param_groups(m), cuda_graph=False) for m in models]
    choice = CaptureChoice(ExecutionSettings(cuda_graph="auto"), CUDA, COMM)
    graph = StepGraph(2)
    choice.bind(graph)
    replayed: list[int] = []

    def replay(body: Any, key: Any, grads: list[torch.Tensor], fresh: bool) -> None:
        replayed.append(len(grads))
        body()

    graph.run = replay  # type: ignore[method-assign]
    opts[0].runner.graph = graph
    x = torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        for step in range(4):
            for model, opt in zip(models, opts, strict=True):
                model(x).square().mean().backward()
                if step in (1, 2):
                    model[2].weight.grad = None
                opt.step()
                opt.zero_grad()
    params = len(list(models[0].parameters()))
    assert replayed == [params, params]  # steps 0 and 3
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)  # the steps the graph did not take ran as eager ones
    assert _capture_lines(caplog) == [
        "muon_dist.Muon: cuda_graph='auto': a step where 1 parameters have no gradient (the "
        "first: 2.weight) runs uncaptured, as later steps with a missing gradient do"
    ]
