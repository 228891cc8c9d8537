"""Which overlap mode each step runs in: the ``overlap`` setting's, or under ``"auto"`` the
trial schedule's (:mod:`muon_dist.step.launch.auto_overlap`) and then the one the ranks chose.

It belongs to the optimizer, not to one step runner: a step rebuilt after a group edit or a
state load keeps the count, the marks and the choice (timing starts over only in a new
optimizer).

A trial step's time runs from the end of the previous ``step()`` to the end of its own: it
holds this iteration's forward, backward and step, all in the step's mode (the hooks of
its backward start buckets only in an overlapped step). On CUDA the end of ``step()`` is a
CUDA event recorded on the current stream, so nothing waits; on CPU ``time.perf_counter``.
Only at the decision step the host waits for the last event, and the ranks holding the
parameters agree on the slowest rank's median per mode (what the job waits for) in one
all-reduce (MAX) of two numbers; every rank then picks the same mode.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from muon_dist.comm.groups import CommGroups
from muon_dist.step.launch.auto_overlap import (
    BACKWARD,
    DECISION_STEP,
    MEASURING,
    NONE,
    TRIALS_PER_MODE,
    choose,
    marked,
    medians,
    trial_mode,
)

logger = logging.getLogger(__name__)


class StepClock(Protocol):
    """Marks the ends of ``step()`` calls; read once, at the decision."""

    def mark(self) -> None:
        """Mark the end of a ``step()`` without waiting for the device."""

    def seconds(self) -> list[float]:
        """The time between consecutive marks, in seconds (may wait for the last mark)."""


class HostClock:
    """``time.perf_counter`` at each mark: on CPU the host's time is the step's."""

    def __init__(self) -> None:
        self._marks: list[float] = []

    def mark(self) -> None:
        self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._marks)]


class CudaClock:
    """A timing event on the current stream at each mark: the device's time, and no wait."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        self._events.append(event)

    def seconds(self) -> list[float]:
        self._events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self._events)]


def device_clock(device: torch.device) -> StepClock:
    """The clock of steps whose work runs on ``device``."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


class OverlapChoice:
    """The overlap mode of each step, for one optimizer.

    ``clock`` may be replaced before the trials (tests, tools) by any :class:`StepClock`;
    ``medians`` holds the agreed (slowest rank's) median step time per mode once chosen.
    """

    def __init__(self, setting: str, device: torch.device) -> None:
        self.device = device
        self.clock: StepClock = device_clock(device)
        self.steps = 0  # step() calls ended under "auto" until the choice
        self.chosen: str | None = None if setting == "auto" else setting
        self.medians: dict[str, float] | None = None

    @property
    def mode(self) -> str:
        """``"none"`` or ``"backward"``: the setting's, or the one ``"auto"`` chose;
        ``"measuring"`` while ``"auto"`` times its trial steps."""
        return MEASURING if self.chosen is None else self.chosen

    @property
    def overlapping(self) -> bool:
        """Whether the current step (the next ``step()`` to end, and the backward before it)
        starts its buckets from gradient hooks."""
        mode = self.chosen if self.chosen is not None else trial_mode(self.steps)
        return mode == BACKWARD

    def step_ended(self, comm: CommGroups) -> None:
        """A ``step()`` ended, on every rank alike (raised or not): mark it where the
        schedule times it, and choose at the decision step (a collective among
        ``comm.holders``)."""
        if self.chosen is not None:
            return
        step = self.steps
        self.steps += 1
        if marked(step):
            self.clock.mark()
        if step == DECISION_STEP:
            self._choose(comm)

    def _choose(self, comm: CommGroups) -> None:
        """Agree on the slowest rank's median per mode and take the faster mode."""
        own = medians(self.clock.seconds())
        slowest = torch.tensor([own[NONE], own[BACKWARD]], dtype=torch.float64, device=self.device)
        holders = comm.holders
        if holders.size > 1:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=holders.group)
        none_s, backward_s = slowest.tolist()
        self.medians = {NONE: none_s, BACKWARD: backward_s}
        self.chosen = choose(none_s, backward_s)
        if comm.rank == holders.ranks[0]:
            logger.info(
                "muon_dist.Muon: overlap='auto' chose overlap=%r: median step %.2f ms plain, "
                "%.2f ms overlapped with backward (%.3fx), the slowest of %d ranks over %d "
                "steps of each mode",
                self.chosen,
                none_s * 1e3,
                backward_s * 1e3,
                backward_s / none_s if none_s > 0 else float("nan"),
                holders.size,
                TRIALS_PER_MODE,
            )
