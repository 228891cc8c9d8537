"""The Muon phase of a step as one program per mode: the ordered stages of a step, decided
once, instead of lifecycle methods and mode flags.

A program opens the step (before its first bucket: at ``step()``, or at the first gradient
hook of a step started during backward), the buckets run, and it closes the step (after
the last bucket). :data:`PROGRAMS` is every mode's program; :class:`Stage` says what each
stage does, and :meth:`muon_dist.step.program.muon_phase.MuonPhase.run_stage` does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from muon_dist.step.shard.modes import StepMode


class Stage(Enum):
    """One stage of a step's program."""

    # No failure and no result flag yet (before the first Newton–Schulz result).
    OPEN = "open"
    # This step's device scalars from the agreement, its unkept matrices dropped (zeroed
    # before Newton–Schulz).
    SCALARS = "scalars"
    # No matrix dropped: the agreement has not run (the buckets start before it).
    DROP_NONE = "drop none"
    # Momentum (where the mode's record says "before the buckets"), Magma, whole-tensor decay.
    ADVANCE = "advance state"
    # Hold every write and state update in the transaction until the commit.
    HOLD = "hold"
    # The wings' work before the buckets (NorMuon's moments side by side).
    START = "start wings"
    # Count the non-finite results and agree on them with the other ranks.
    AGREE = "agree on results"
    # The same, counting only the results of kept matrices (none was dropped before).
    AGREE_KEPT = "agree on kept results"
    # A non-finite result anywhere skips the whole step.
    SKIP = "skip on results"
    # Stage the scalars again and apply what was held where kept: momentum ("at the
    # commit"), Magma, decay, the held writes.
    COMMIT = "commit"
    # The wings' work after the buckets (NorMuon's all-reduce of the rows' sums).
    FINISH = "finish wings"


@dataclass(frozen=True)
class Program:
    """A step's stages in one mode: ``opening`` before its buckets, ``closing`` after."""

    mode: StepMode
    opening: tuple[Stage, ...]
    closing: tuple[Stage, ...]


_HELD_OPENING = (Stage.OPEN, Stage.SCALARS, Stage.HOLD, Stage.START)
_EARLY_OPENING = (Stage.OPEN, Stage.DROP_NONE, Stage.HOLD, Stage.START)

PROGRAMS = {
    p.mode: p
    for p in (
        Program(
            StepMode.PLAIN,
            (Stage.OPEN, Stage.SCALARS, Stage.ADVANCE, Stage.START),
            (Stage.AGREE, Stage.FINISH),
        ),
        Program(
            StepMode.TRANSACTIONAL,
            _HELD_OPENING,
            (Stage.AGREE, Stage.SKIP, Stage.COMMIT, Stage.FINISH),
        ),
        Program(
            StepMode.EARLY,
            _EARLY_OPENING,
            (Stage.SCALARS, Stage.AGREE_KEPT, Stage.COMMIT, Stage.FINISH),
        ),
        Program(
            StepMode.EARLY_TRANSACTIONAL,
            _EARLY_OPENING,
            (Stage.SCALARS, Stage.AGREE_KEPT, Stage.SKIP, Stage.COMMIT, Stage.FINISH),
        ),
    )
}


def format_programs() -> str:
    """Every mode's program as text, one line per mode."""
    return "\n".join(
        f"{p.mode.value}: "
        + " → ".join(s.value for s in p.opening)
        + " → buckets → "
        + " → ".join(s.value for s in p.closing)
        for p in PROGRAMS.values()
    )
