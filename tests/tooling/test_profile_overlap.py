"""benchmarks/profile_overlap.py's trace arithmetic, on a hand-made Chrome trace."""

from __future__ import annotations

import sys

import pytest
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_overlap


def _kernel(stream: int, start: float, end: float) -> dict[str, object]:
    return {"cat": "kernel", "ts": start, "dur": end - start, "args": {"stream": stream}}


def test_analyze_splits_streams_idle_time_and_hooks() -> None:
    # Main stream (7): busy 0-400 and 600-1000 us; side stream (20): 300-700 us, of which
    # 300-400 and 600-700 run beside the main stream; nothing runs 400-600 except the side.
    events = [_kernel(7, 0, 400), _kernel(7, 600, 1000), _kernel(20, 300, 700)]
    events += [{"cat": "user_annotation", "name": profile_overlap.HOOK, "ts": 0, "dur": 50}] * 4
    out = profile_overlap.analyze({"traceEvents": events}, steps=2)
    assert out["GPU span ms"] == pytest.approx(0.5)
    assert out["idle ms"] == pytest.approx(0.0)
    assert out["main stream ms"] == pytest.approx(0.4)
    assert out["other streams ms"] == pytest.approx(0.2)
    assert out["beside main ms"] == pytest.approx(0.1)
    assert out["hook host ms"] == pytest.approx(0.1)
    assert out["hooks per step"] == 2


def test_union_and_intersection_lengths() -> None:
    assert profile_overlap.union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert profile_overlap.intersection_length([(0, 4)], [(2, 6), (7, 8)]) == 2
