"""``overlap="auto"``: the mode each step runs in while it measures, and the choice.

Pure, and the same on every rank: until the choice, the mode of step ``t`` (the ``t``-th
call of ``step()``, counted from 0) is a function of ``t`` alone, so every rank knows it
without communication, and the gradient hooks of step ``t`` know it before its backward
begins. What the steps measure and how the ranks agree: :mod:`muon_dist.step.launch.overlap_choice`.

- ``WARMUP_STEPS`` (2) plain steps are not timed: the first steps carry one-time costs
  (Triton compilation and autotuning, the allocator's growth, the first collectives) that
  say nothing about either mode. A step's time runs from the end of the previous
  ``step()`` to the end of its own, so warm-up must also give the first trial its start.
- Then ``TRIAL_BLOCKS`` (2) rounds of ``TRIAL_BLOCK`` (plain, overlapped, overlapped,
  plain): 4 steps of each mode, 10 steps in all, a small part of any run worth measuring.
  The block is counterbalanced: both modes sit at the same mean position (3.5 of 0-7), so
  a slow drift (clocks, caches, the data loader) moves both medians alike, where plain
  alternation would time every overlapped step one step later than its plain partner.
- Each mode's figure is its median: one outlier per mode (a checkpoint save, an evaluation,
  the overlap's first use of its own communicator) moves it little.
- The choice is the mode whose median, the slowest rank's (agreed by the caller), is lower;
  a tie keeps plain, which reads nothing on the host per step and holds no updates through
  backward.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

NONE = "none"
BACKWARD = "backward"
MEASURING = "measuring"

WARMUP_STEPS = 2
TRIAL_BLOCK = (NONE, BACKWARD, BACKWARD, NONE)
TRIAL_BLOCKS = 2
TRIAL_STEPS = len(TRIAL_BLOCK) * TRIAL_BLOCKS
TRIALS_PER_MODE = TRIAL_BLOCK.count(NONE) * TRIAL_BLOCKS
# The step at whose end the mode is chosen: the last trial.
DECISION_STEP = WARMUP_STEPS + TRIAL_STEPS - 1


def trial_mode(step: int) -> str | None:
    """The mode step ``step`` runs in while measuring: plain in warm-up, then the trials'
    order; None after the decision step (the choice holds from then on)."""
    if step < WARMUP_STEPS:
        return NONE
    trial = step - WARMUP_STEPS
    if trial < TRIAL_STEPS:
        return TRIAL_BLOCK[trial % len(TRIAL_BLOCK)]
    return None


def marked(step: int) -> bool:
    """Whether the end of step ``step`` is marked on the clock: the last warm-up step's (the
    first trial's start) and each trial's."""
    return WARMUP_STEPS - 1 <= step <= DECISION_STEP


def medians(seconds: Sequence[float]) -> dict[str, float]:
    """Per mode, the median time of its trial steps; ``seconds`` holds every trial's time,
    in order."""
    if len(seconds) != TRIAL_STEPS:
        raise ValueError(
            f"overlap='auto' times {TRIAL_STEPS} trial steps, and got {len(seconds)} times; "
            "mark the clock once at the end of each step() that marked() names"
        )
    by_mode: dict[str, list[float]] = {NONE: [], BACKWARD: []}
    for trial, time in enumerate(seconds):
        by_mode[TRIAL_BLOCK[trial % len(TRIAL_BLOCK)]].append(time)
    return {mode: statistics.median(times) for mode, times in by_mode.items()}


def choose(none_s: float, backward_s: float) -> str:
    """The faster mode by the agreed medians; plain unless the overlap is strictly faster."""
    return BACKWARD if backward_s < none_s else NONE
