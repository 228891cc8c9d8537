"""Unsupported placements and rank disagreement raise clear errors instead of hanging."""

from __future__ import annotations

from dist_error_cases import CASES, error_worker
from dist_harness import run_distributed


def test_bad_layouts_raise_on_every_rank() -> None:
    results = run_distributed(2, error_worker, timeout=180)
    assert results == [list(CASES)] * 2
