"""examples/train.py's measurement: batches built ahead on a thread without changing them,
and step phases timed from a common start as the slowest rank sees them."""

from __future__ import annotations

import threading
from dataclasses import astuple

import pytest
import torch
from dist_harness import run_distributed
from train_timing_cases import slowest_rank_worker, train

CPU = torch.device("cpu")


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_batches_are_the_inline_ones_built_ahead(depth: int) -> None:
    """Same batches, same order, as ``make(step)`` inline; the next ``depth`` start building
    on another thread while the consumer still holds the current one, and none past them."""
    started = {step: threading.Event() for step in range(3, 12)}
    threads: set[str] = set()

    def make(step: int) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        started[step].set()
        return torch.arange(4) * step

    seen = []
    for step, batch, waited in train.prefetched(make, range(3, 8), CPU, depth):
        # Nothing is asked of the generator here: only a thread running ahead sets these.
        for ahead in range(step + 1, min(step + depth, 7) + 1):
            assert started[ahead].wait(timeout=30), f"step {ahead} was not built ahead"
        beyond = step + depth + 1
        assert not started[beyond].is_set(), f"step {beyond} built more than {depth} ahead"
        assert torch.equal(batch, torch.arange(4) * step) and waited >= 0.0
        seen.append(step)
    assert seen == [3, 4, 5, 6, 7]
    assert not started[8].is_set(), "built a batch past the last step"
    assert threading.current_thread().name not in threads


def test_prefetched_stops_building_when_closed_early() -> None:
    built: list[int] = []

    def make(step: int) -> torch.Tensor:
        built.append(step)
        return torch.zeros(1)

    batches = train.prefetched(make, range(1, 100), CPU, 3)
    assert next(batches)[0] == 1
    batches.close()
    # Closing cancels the batches ahead that have not started, and waits for the one that
    # has: nothing past the 3 submitted ahead of the current one is ever built.
    assert built == list(range(1, len(built) + 1)) and len(built) <= 4, built
    assert not [t for t in threading.enumerate() if t.name.startswith("batches")]


def test_step_timer_reports_each_phase_of_the_slowest_rank() -> None:
    """Rank 1 is slow in forward+backward, rank 0 in the optimizer and late to the step:
    every rank reports the same maxima, and the late arrival is not timed."""
    sleeps = {
        "late": [1.0, 0.0],
        "fwd_bwd": [0.0, 0.2],
        "opt": [0.15, 0.0],
        "data_wait": [0.3, 0.1],
    }
    results = run_distributed(2, slowest_rank_worker, sleeps)
    assert astuple(results[0]) == astuple(results[1]), results
    times = results[0]
    assert times.data_wait == 0.3
    assert times.fwd_bwd >= 0.2 and times.opt >= 0.15
    # The step is the slowest rank's whole step: at least its phases, at most their sum
    # (each phase's maximum may come from a different rank), and it starts after the barrier.
    assert max(times.fwd_bwd, times.opt) <= times.step <= times.fwd_bwd + times.opt + 1e-9
    assert times.step < 1.0, "the wait for the late rank was timed"
