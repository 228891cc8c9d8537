"""The slow tier of test_backward_overlap.py: overlap="backward" bitwise equal to the plain
step on the other layouts."""

from __future__ import annotations

import pytest
from test_backward_overlap import test_bitwise_equal_to_plain_step as check


@pytest.mark.parametrize(
    ("world_size", "layout"),
    [(3, "fsdp"), (2, "hsdp"), (2, "experts"), (2, "magma_cautious"), (2, "dion2")],
)
def test_bitwise_equal_to_plain_step(world_size: int, layout: str) -> None:
    check(world_size, layout)
