"""The generator task runtime and the Muon bucket task it runs."""

from muon_dist.runtime.scheduler import Task, TaskError, run_tasks

__all__ = ["Task", "TaskError", "run_tasks"]
