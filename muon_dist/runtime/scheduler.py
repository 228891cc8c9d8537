"""A cooperative scheduler for generator tasks that overlap collectives with compute.

A task issues an asynchronous collective and yields; while it is suspended, the scheduler
advances other tasks, whose compute then overlaps that collective. The order is fixed, so
every rank issues its collectives in the same sequence as long as each task yields the same
number of times on every rank.

Tasks run as a staggered pipeline. Each round admits at most one new task and then advances
every active task once, newest first. A bucket task has three phases (start its gather;
compute and start its scatter; apply), so with three tasks in flight each round issues the
next bucket's gather before the current bucket's Newton–Schulz is queued, and applies the
previous bucket's results once its scatter has had that Newton–Schulz to hide behind. A
plain round-robin over the same tasks would queue all their Newton–Schulz work back to back
and start the next gather only behind it, leaving the GPU idle while it arrives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass

TaskBody = Generator[None, None, None]


@dataclass
class Task:
    """A generator plus the parameter names it touches, for error messages."""

    names: tuple[str, ...]
    body: TaskBody


class TaskError(RuntimeError):
    """A task failed; the message names the parameters the task was working on."""


class Pipeline:
    """The staggered pipeline, fed one task at a time: each :meth:`round` admits at most one
    queued task and then advances every active task once, newest first. The collectives
    it issues depend only on the sequence of :meth:`add` and :meth:`round` calls, not on
    when they happen, so ranks that make the same calls issue the same collectives."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._queued: deque[Task] = deque()
        self._active: list[Task] = []  # oldest first

    def add(self, task: Task) -> None:
        self._queued.append(task)

    @property
    def idle(self) -> bool:
        return not self._queued and not self._active

    def round(self) -> None:
        active = self._active
        if len(active) < self.max_inflight and self._queued:
            active.append(self._queued.popleft())
        for task in reversed(list(active)):
            try:
                next(task.body)
            except StopIteration:
                active.remove(task)
            except Exception as exc:
                for other in active:
                    if other is not task:
                        other.body.close()
                active.clear()
                self._queued.clear()
                names = ", ".join(task.names)
                raise TaskError(f"muon_dist task for parameters [{names}] failed: {exc}") from exc

    def finish(self) -> None:
        """Run rounds until every task added has finished."""
        while not self.idle:
            self.round()


def run_tasks(tasks: Iterable[Task], max_inflight: int) -> None:
    """Run tasks as a staggered pipeline with at most ``max_inflight`` started and unfinished."""
    pipeline = Pipeline(max_inflight)
    for task in tasks:
        pipeline.add(task)
    pipeline.finish()
