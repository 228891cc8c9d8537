"""The split of a bucket's stacks over a captured step's streams
(:func:`muon_dist.step.bucket.orthogonalizer.lanes`): pure, so tested without a GPU."""

from __future__ import annotations

import pytest

from muon_dist.step.bucket.orthogonalizer import lanes


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
