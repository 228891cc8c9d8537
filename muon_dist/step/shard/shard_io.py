"""Where each view's local-shard read, write, momentum advance, decay and Dion2's feedback
happen: decided once when a step is bound to its plan, so no reader of the step has to hold
fused-read x fused-write x Magma x cautious x rule together.

A fused read (one pass advances the momentum and casts the Newton–Schulz input) needs the
view's pieces to cover its shard exactly once and no Magma (which needs the advanced
momentum first); a fused write (one launch decays and adds) needs the same and no cautious
decay (which needs the update's sign). :func:`format_shard_io_table` prints the records as
``Muon.runner.muon.shard_io_table()`` shows them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Flag
from typing import Any

from muon_dist.step.shard.modes import StepMode

# Reads: one fused pass that also advances the momentum, or torch's Nesterov mix and cast
# of a momentum advanced before.
READ_FUSED, READ_TORCH = "fused", "torch"
# Where the momentum advances and is stored: in the (fused) read, before the buckets, or,
# where the step holds its writes (every mode but the plain one), at the commit, the reads
# advancing it without storing it.
MOMENTUM_IN_READ, MOMENTUM_BEFORE = "in the read", "before the buckets"
MOMENTUM_AT_COMMIT = "at the commit"
# Writes: one launch for all fused pieces; batched torch launches (one shared step per
# step class where the tensor has a local gradient, else each piece's own step, one
# foreach); one piece at a time (cautious decay needs the sign, Magma a per-row step).
WRITE_FUSED, WRITE_BATCHED, WRITE_SINGLE = "fused", "batched", "single"
# Decoupled decay: in the fused write, over the whole tensor before the buckets, or
# cautiously in the piece's own write.
DECAY_IN_WRITE, DECAY_TENSOR, DECAY_CAUTIOUS = "in the write", "whole tensor", "cautious"
# Dion2's error feedback on the momentum: none, inside the fused write, or its own pass
# right before the write.
FEEDBACK_NONE, FEEDBACK_IN_WRITE, FEEDBACK_BESIDE = "-", "in the write", "before the write"


@dataclass(frozen=True)
class ShardIO:
    """Where one matrix view's shard I/O happens (the module's constants name the places)."""

    name: str
    read: str
    momentum: str
    write: str
    decay: str
    feedback: str

    @property
    def fused_read(self) -> bool:
        return self.read == READ_FUSED

    def momentum_at(self, mode: StepMode) -> str:
        """Where the momentum advances and is stored in a step of ``mode``: the one answer
        both the read and the state advance ask (:attr:`momentum` is the plain step's)."""
        return MOMENTUM_AT_COMMIT if mode.holds else self.momentum

    @property
    def fused_write(self) -> bool:
        return self.write == WRITE_FUSED

    @property
    def decays_tensor(self) -> bool:
        return self.decay == DECAY_TENSOR


class Fused(Flag):
    """Which of a view's shard passes take the fused form (decided by the binding)."""

    NONE = 0
    READ = 1
    WRITE = 2


def shard_io(name: str, fused: Fused, group: dict[str, Any], feedback: object | None) -> ShardIO:
    """The record of a view whose ``fused`` passes take the fused form, in ``group``
    (cautious decay, Magma), whose rule's write part is ``feedback`` (None: none)."""
    cautious, fused_write = bool(group["cautious_wd"]), Fused.WRITE in fused
    single = cautious or bool(group["magma"])
    write = WRITE_FUSED if fused_write else WRITE_SINGLE if single else WRITE_BATCHED
    if fused_write:
        decay = DECAY_IN_WRITE
    else:
        decay = DECAY_CAUTIOUS if cautious else DECAY_TENSOR
    if feedback is None:
        fed = FEEDBACK_NONE
    else:
        fed = FEEDBACK_IN_WRITE if fused_write else FEEDBACK_BESIDE
    fused_read = Fused.READ in fused
    return ShardIO(
        name,
        READ_FUSED if fused_read else READ_TORCH,
        MOMENTUM_IN_READ if fused_read else MOMENTUM_BEFORE,
        write,
        decay,
        fed,
    )


def format_shard_io_table(records: Iterable[ShardIO]) -> str:
    """The records as an aligned text table, one row per view."""
    header = ("view", "read", "momentum", "write", "decay", "dion2 feedback")
    rows = [header]
    rows += [(r.name, r.read, r.momentum, r.write, r.decay, r.feedback) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        "a transactional step, or one started during backward, advances every momentum in "
        "the read without storing it and stores it at the commit"
    )
    return "\n".join(lines)
