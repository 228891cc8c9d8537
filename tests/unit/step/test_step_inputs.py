"""The host's values of a step, staged into the device buffer the step reads
(:class:`muon_dist.step.shard.scalars.StepInputs`)."""

from __future__ import annotations

import math

import torch

from muon_dist.step.shard.scalars import StepInputs, norm_limit


def _groups() -> list[dict[str, object]]:
    return [
        {"algorithm": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95},
        {"algorithm": "adamw", "lr": 3e-4, "weight_decay": 0.0},
    ]


def test_stage_writes_each_value_where_the_step_reads_it() -> None:
    groups = _groups()
    inputs = StepInputs.allocate(2, [0, 1, 0], 2, torch.device("cpu"))
    inputs.stage(groups, [True, False, True], None, [5.0, -5.0])
    expected = torch.tensor([0.02, 3e-4], dtype=torch.float32)
    assert torch.equal(inputs.lr, expected)
    assert torch.equal(inputs.weight_decay, torch.tensor([0.1, 0.0], dtype=torch.float32))
    assert inputs.present.tolist() == [1.0, 0.0, 1.0]
    muon_limit = torch.tensor(norm_limit(groups[0]), dtype=torch.float32).item()
    assert inputs.norm_limit.tolist() == [muon_limit, math.inf, muon_limit]
    assert inputs.failed.tolist() == [0.0]
    assert inputs.compared.tolist() == [5.0, -5.0]
    # A later step's values replace every earlier one.
    groups[0]["lr"] = 0.01
    inputs.stage(groups, [False, True, True], None, [1.0, -1.0])
    assert inputs.lr[0].item() == torch.tensor(0.01, dtype=torch.float32).item()
    assert inputs.present.tolist() == [0.0, 1.0, 1.0]
    assert inputs.compared.tolist() == [1.0, -1.0]


def test_a_refusing_rank_stages_nothing_read_from_its_groups() -> None:
    """A refusal stages zeros, no norm limits and the rank (+ 1), whatever the groups hold:
    their values may be what it refused."""
    groups = _groups()
    groups[0]["lr"] = math.nan
    inputs = StepInputs.allocate(2, [0, 1, 0], 2, torch.device("cpu"))
    inputs.stage(_groups(), [True, True, True], None, [5.0, -5.0])
    inputs.stage(groups, [True, True, True], 3, [])
    assert inputs.lr.tolist() == [0.0, 0.0] and inputs.weight_decay.tolist() == [0.0, 0.0]
    assert inputs.present.tolist() == [0.0, 0.0, 0.0]
    assert inputs.norm_limit.tolist() == [math.inf] * 3
    assert inputs.failed.tolist() == [4.0]
    assert inputs.compared.tolist() == [0.0, 0.0]
