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
    """Run tasks as a staggered pipeline with at most ``max_inflight`` started and unfinished."""
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    pending = iter(tasks)
    active: list[Task] = []  # oldest first
    while True:
        if len(active) < max_inflight:
            task = next(pending, None)
            if task is not None:
                active.append(task)
        if not active:
            return
        for task in reversed(list(active)):
            try:
                next(task.body)
            except StopIteration:
                active.remove(task)
            except Exception as exc:
                for other in active:
                    if other is not task:
                        other.body.close()
                names = ", ".join(task.names)
                raise TaskError(f"muon_dist task for parameters [{names}] failed: {exc}") from exc
