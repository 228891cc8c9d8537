"""The slow tier of test_dion2_transport.py: the bytes a rank sends in a Dion2 step against
Muon's (gloo, CPU), at most 0.3x at ``dion2_fraction=0.25``."""

from __future__ import annotations

import pytest
from test_dion2_transport import dion2_sends_a_quarter_of_muons_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_dion2_sends_a_quarter_of_muons_bytes(world_size: int) -> None:
    dion2_sends_a_quarter_of_muons_bytes(world_size)
