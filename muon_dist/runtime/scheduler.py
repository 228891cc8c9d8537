"""A cooperative scheduler for generator tasks that overlap collectives with compute.

A task issues an asynchronous collective and yields; while it is suspended, the scheduler
advances other tasks, whose compute then overlaps that collective. Tasks are advanced in a
fixed round-robin order, so every rank issues its collectives in the same sequence as long
as each task yields the same number of times on every rank.
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


def run_tasks(tasks: Iterable[Task], max_inflight: int) -> None:
    """Advance tasks round-robin with at most ``max_inflight`` started and unfinished."""
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    pending = iter(tasks)
    active: deque[Task] = deque()

    def admit() -> None:
        while len(active) < max_inflight:
            task = next(pending, None)
            if task is None:
                return
            active.append(task)

    admit()
    while active:
        task = active.popleft()
        try:
            next(task.body)
        except StopIteration:
            admit()
            continue
        except Exception as exc:
            for other in active:
                other.body.close()
            names = ", ".join(task.names)
            raise TaskError(f"muon_dist task for parameters [{names}] failed: {exc}") from exc
        active.append(task)
