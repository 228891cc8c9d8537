"""The task runtime, driven by fake tasks: ordering, the in-flight bound, errors."""

from __future__ import annotations

import pytest

from muon_dist.runtime import Task, TaskError, run_tasks
from muon_dist.runtime.scheduler import TaskBody


def _fake(name: str, yields: int, log: list[str], live: set[str], peak: list[int]) -> Task:
    def body() -> TaskBody:
        live.add(name)
        peak[0] = max(peak[0], len(live))
        for k in range(yields):
            log.append(f"{name}{k}")
            yield
        log.append(f"{name}end")
        live.discard(name)

    return Task((name,), body())


@pytest.mark.parametrize("max_inflight", [1, 2, 3, 5])
def test_staggered_order_and_inflight_bound(max_inflight: int) -> None:
    log: list[str] = []
    live: set[str] = set()
    peak = [0]
    tasks = [_fake(n, 2, log, live, peak) for n in "abcd"]
    run_tasks(tasks, max_inflight)
    # One task is admitted per round and each lives three rounds (two yields).
    assert peak[0] == min(max_inflight, 3)
    assert sorted(log) == sorted(f"{n}{k}" for n in "abcd" for k in ("0", "1", "end"))
    for n in "abcd":  # each task's own steps stay in order
        mine = [e for e in log if e[0] == n]
        assert mine == [f"{n}0", f"{n}1", f"{n}end"]
    if max_inflight == 1:
        assert log == [f"{n}{k}" for n in "abcd" for k in ("0", "1", "end")]
    if max_inflight == 3:
        # Each round admits one task and advances the active ones newest first, so the
        # next task starts (its gather) before the previous one computes.
        rounds = [["a0"], ["b0", "a1"], ["c0", "b1", "aend"], ["d0", "c1", "bend"]]
        assert log == [e for r in rounds for e in r] + ["d1", "cend", "dend"]


def test_order_is_deterministic() -> None:
    runs = []
    for _ in range(2):
        log: list[str] = []
        run_tasks(
            [_fake(n, k, log, set(), [0]) for n, k in zip("abcde", [0, 3, 1, 2, 0], strict=True)], 3
        )
        runs.append(log)
    assert runs[0] == runs[1]


def test_error_names_parameters_and_closes_other_tasks() -> None:
    closed: list[str] = []

    def good() -> TaskBody:
        try:
            while True:
                yield
        finally:
            closed.append("good")

    def bad() -> TaskBody:
        yield
        raise ValueError("boom")

    tasks = [Task(("layers.0.w",), good()), Task(("layers.1.w", "layers.1.v"), bad())]
    with pytest.raises(TaskError, match=r"\[layers.1.w, layers.1.v\] failed: boom"):
        run_tasks(tasks, 2)
    assert closed == ["good"]


def test_rejects_bad_inflight() -> None:
    with pytest.raises(ValueError, match="max_inflight must be >= 1"):
        run_tasks([], 0)
