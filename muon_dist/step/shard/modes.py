"""The modes a Muon step runs in, one enum: which program the step is
(:mod:`muon_dist.step.program.stages`), and the key every record decided at bind time is
read by (:meth:`muon_dist.step.shard.shard_io.ShardIO.momentum_at`, the compiled reads and
writes, each mode's bucket I/O)."""

from __future__ import annotations

from enum import Enum


class StepMode(Enum):
    """How one step runs.

    ``PLAIN``: after the agreement, every write lands as its bucket finishes.
    ``TRANSACTIONAL`` (``nonfinite="skip_step"``): writes and state updates are held until
    every rank knows each Newton–Schulz result is finite. ``EARLY`` (``overlap="backward"``,
    and the steps ``"auto"`` overlaps): buckets start from gradient hooks, before the
    agreement, so everything is held until ``step()``; ``EARLY_TRANSACTIONAL`` adds the
    skip on a non-finite result. (A rank whose rebuilt plan the others do not share runs
    the previous plan's program in the mode they run, with the agreement refusing every
    tensor: :meth:`muon_dist.step.runner.StepRunner.mirror`.)
    """

    PLAIN = "plain"
    TRANSACTIONAL = "transactional"
    EARLY = "early"
    EARLY_TRANSACTIONAL = "early transactional"

    @classmethod
    def pair(cls, nonfinite: str) -> tuple[StepMode, StepMode]:
        """The modes of a plain and of an early step under the ``nonfinite`` policy."""
        if nonfinite == "skip_step":
            return cls.TRANSACTIONAL, cls.EARLY_TRANSACTIONAL
        return cls.PLAIN, cls.EARLY

    @property
    def holds(self) -> bool:
        """Whether writes and state updates wait in the transaction for the commit."""
        return self is not StepMode.PLAIN

    @property
    def early(self) -> bool:
        """Whether buckets start from gradient hooks, before the agreement."""
        return self in (StepMode.EARLY, StepMode.EARLY_TRANSACTIONAL)
