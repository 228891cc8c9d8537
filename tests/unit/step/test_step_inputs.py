"""The host's values of a step, staged into the device buffer the step reads
(:class:`muon_dist.step.shard.scalars.StepInputs`), and the split of a bucket's stacks over
streams (:func:`muon_dist.step.bucket.orthogonalizer.lanes`)."""

from __future__ import annotations

import math

import pytest
import torch

from muon_dist.step.bucket.orthogonalizer import lanes
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


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize(
    "costs",
    [[8.0, 1.0, 1.0, 6.0], [5.0, None, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [None, 3.0, None]],
)
def test_lanes_balance_the_stacks_that_may_run_beside(
    costs: list[float | None], count: int
) -> None:
    lane = lanes(costs, count)
    assert len(lane) == len(costs) and all(0 <= k < count for k in lane)
    assert all(lane[i] == 0 for i, c in enumerate(costs) if c is None)
    pairs = list(zip(costs, lane, strict=True))
    load = [sum(c or 0.0 for c, k in pairs if k == side) for side in range(count)]
    placed = [c for c in costs if c is not None]
    # Largest first to the lightest lane: no lane ends more than the largest stack's cost
    # after another, and as many lanes are used as there are stacks to place (up to count).
    assert max(load) - min(load) <= max(placed)
    used = {lane[i] for i, c in enumerate(costs) if c is not None}
    assert len(used) == min(len(placed), count)
