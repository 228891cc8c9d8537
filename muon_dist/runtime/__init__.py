"""The generator task runtime and the Muon bucket task it runs."""

from muon_dist.runtime.scheduler import Pipeline, Task, TaskError, run_tasks

__all__ = ["Pipeline", "Task", "TaskError", "run_tasks"]
