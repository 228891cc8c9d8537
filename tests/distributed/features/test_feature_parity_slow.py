"""The slow tier of test_feature_parity.py: every other feature case on 1, 2 and 4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_feature_parity import cases
from test_feature_parity import test_features_match_single_device as check


@pytest.mark.parametrize(("world_size", "name"), cases(quick=False))
def test_features_match_single_device(world_size: int, name: str, tmp_path: Path) -> None:
    check(world_size, name, tmp_path)
