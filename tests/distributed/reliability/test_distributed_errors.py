"""Unsupported placements and rank disagreement raise clear errors instead of hanging."""

from __future__ import annotations

import pytest
from dist_error_cases import CASES, error_worker
from dist_harness import run_distributed


@pytest.mark.parametrize("name", list(CASES))
def test_bad_layout_raises_on_every_rank(name: str) -> None:
    assert run_distributed(2, error_worker, name, timeout=180) == [name] * 2
