"""The host's later view of a step's outcome: a copy of the agreement's flags, queued as part
of the step (captured or not) and read only where the host asks (``step()``,
``state_dict()``, ``check_finite()``), waiting for that step alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from muon_dist.step.shard.scalars import NS_NORM_LIMIT, Segments

logger = logging.getLogger(__name__)

# Per-parameter gradient verdicts; the all-reduce takes the worst (MAX) over ranks.
TOO_LARGE = 1.0  # finite, but its norm would overflow Newton–Schulz's normalisation
NONFINITE = 2.0  # a NaN or an infinity somewhere in it


@dataclass(frozen=True)
class Compared:
    """One group entry the ranks compare at each step: its label, and whether it travels as
    its numbers (the step values and counts, shown as a range) or as a digest of its
    ``repr`` (shown as this rank's value)."""

    label: str
    key: str
    group: int
    numeric: bool


@dataclass(frozen=True)
class Outcome:
    """What went wrong in one step, as every rank saw it. ``failed_rank`` is a rank whose
    inputs were refused (it raised the error naming them), None when every rank's were fine."""

    step: int
    nonfinite_grads: tuple[str, ...]
    nonfinite_results: tuple[str, ...]
    overflowing_grads: tuple[str, ...] = ()
    failed_rank: int | None = None
    crashed_rank: int | None = None  # a rank whose Newton–Schulz raised during the step
    disagreement: str | None = None  # what differed across ranks (options or replicas' grads)


class Report:
    """A step's outcome as the host reads it: per parameter its gradient's verdict, per
    Muon parameter its non-finite results, the ranks that failed or crashed, and what the
    ranks compared. ``flags`` is the agreement's buffer of every flag of a step, laid out
    by ``layout`` (segments ``verdict``, ``bad_results``, ``crashed``, ``failed``,
    ``found_inf`` and ``compared``); ``compared`` lays out its compared part."""

    def __init__(
        self,
        names: Sequence[str],
        muon_names: Sequence[str],
        entries: Sequence[Compared],
        replicated_names: Sequence[str],
        ranks: Sequence[int],
        compared: Segments,
        layout: Segments,
        flags: torch.Tensor,
    ) -> None:
        self.names, self.muon_names, self.entries = list(names), list(muon_names), list(entries)
        self.shown: list[str] = []  # this rank's compared entries as text, as last staged
        self._replicated_names = list(replicated_names)
        self._ranks = list(ranks)
        self._compared_layout = compared
        self._flags = flags
        pinned = flags.device.type == "cuda"
        self._host = torch.zeros_like(flags, device="cpu", pin_memory=pinned)
        # A numpy view of the host copy (on the CPU, of the flags themselves, read before
        # the next step): reading it is a plain memory read, made once here.
        self._segments = layout.views(self._host.numpy() if pinned else flags.numpy())
        self._event = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]
        self._pending: int | None = None  # step number whose report is queued, unread

    def copy(self) -> None:
        """Queue the host copy of the step's flags (part of a captured step): one copy of
        the whole buffer, no device work."""
        if self._event is not None:
            self._host.copy_(self._flags, non_blocking=True)

    def queued(self, step: int) -> None:
        """Mark the copy queued by :meth:`copy` as the outcome of ``step`` (host side)."""
        if self._event is not None:
            self._event.record()
        self._pending = step

    def discard(self) -> None:
        """Forget the queued outcome: this rank failed the step and raises its own error."""
        self._pending = None

    @property
    def on_host(self) -> bool:
        """Whether the queued outcome can be read without waiting for a device."""
        return self._event is None

    def read(self) -> Outcome | None:
        """The queued outcome if anything went wrong in it; waits only for that step."""
        if self._pending is None:
            return None
        step, self._pending = self._pending, None
        if self._event is not None:
            self._event.synchronize()
        read = self._segments
        crashed, failed, found_inf = (read[key][0] for key in ("crashed", "failed", "found_inf"))
        results = read["bad_results"]
        if not found_inf and not crashed and not results.any():
            return None
        verdicts = read["verdict"]
        return Outcome(
            step,
            tuple(n for n, v in zip(self.names, verdicts, strict=True) if v == NONFINITE),
            tuple(n for n, v in zip(self.muon_names, results, strict=True) if v),
            tuple(n for n, v in zip(self.names, verdicts, strict=True) if v == TOO_LARGE),
            int(failed) - 1 if failed else None,
            int(crashed) - 1 if crashed else None,
            self._disagreement(read["compared"]),
        )

    def _disagreement(self, compared: np.ndarray[Any, Any]) -> str | None:
        """What the ranks disagreed on in the compared part of a report, or None."""
        if not compared.size:
            return None
        segment = self._compared_layout.views(compared)
        largest, smallest = segment["values"], -segment["negated"]
        digests, norms, low_norms = segment["digests"], segment["norms"], -segment["negated_norms"]
        parts = [
            f"{entry.label} ranges from {low:.7g} to {high:.7g}"
            if entry.numeric
            else f"{entry.label} differs ({shown} on this rank)"
            for entry, high, low, shown in zip(
                self.entries, largest.tolist(), smallest.tolist(), self.shown, strict=True
            )
            if high > low
        ]
        if parts:
            classes: dict[float, list[int]] = {}
            for rank, digest in zip(self._ranks, digests.tolist(), strict=True):
                classes.setdefault(digest, []).append(rank)
            parts.append(
                "ranks by their options: " + " | ".join(str(ranks) for ranks in classes.values())
            )
        differing = [
            n
            for n, high, low in zip(
                self._replicated_names,
                norms.tolist(),
                low_norms.tolist(),
                strict=True,
            )
            if high > low
        ]
        if differing:
            parts.append(
                f"the gradient of {', '.join(differing)}, held whole on every rank (a replica), "
                "differs across ranks (its norm does); every rank applies one update to a "
                "replica, so its gradients must be equal: average them first (DDP does, or "
                "dist.all_reduce(p.grad, op=dist.ReduceOp.AVG))"
            )
        return "; ".join(parts) or None


def apply_policy(outcome: Outcome, nonfinite: str, groups: list[dict[str, Any]]) -> None:
    """Raise for a failed step, or count and log a skipped one (``nonfinite``)."""
    skip = nonfinite == "skip_step"
    if (
        outcome.failed_rank is not None
        or outcome.disagreement is not None
        or (outcome.crashed_rank is not None and skip)
        or (not skip and (outcome.nonfinite_grads or outcome.overflowing_grads))
    ):
        for group in groups:  # nothing changed: not a step
            group["steps"] -= 1
    _raise_failure(outcome, nonfinite)
    reason = _reason(outcome)
    if skip:
        for group in groups:
            group["skipped_steps"] += 1
        logger.warning(
            "muon_dist.Muon: skipped step %d (%s); %d skipped so far",
            outcome.step,
            reason,
            groups[0]["skipped_steps"],
        )
        return
    if outcome.nonfinite_grads or outcome.overflowing_grads:
        raise FloatingPointError(
            f"muon_dist.Muon step {outcome.step}: {reason}; parameters and state were left as "
            "they were; fix the loss (or clip gradients) or pass nonfinite='skip_step' "
            "to skip such steps"
        )
    raise FloatingPointError(
        f"muon_dist.Muon step {outcome.step}: Newton–Schulz returned non-finite values for "
        f"{', '.join(outcome.nonfinite_results)} although every gradient was finite; "
        "either a momentum grew past a Frobenius norm of about 1.8e19 (lower the lr or "
        "clip gradients) or a kernel or device failed (try backend='torch'); those "
        "parameters were updated"
    )


def _raise_failure(outcome: Outcome, nonfinite: str) -> None:
    """Raise where a rank failed, crashed or the ranks disagreed."""
    step = outcome.step
    if outcome.crashed_rank is not None:
        kept = (
            "parameters and state were left as they were on every rank"
            if nonfinite == "skip_step"
            else "under nonfinite='raise' the rest of the step was applied and the failed "
            "matrices may be partly updated ('skip_step' leaves everything as it was)"
        )
        raise RuntimeError(
            f"muon_dist.Muon step {step} failed on rank {outcome.crashed_rank}: its "
            "Newton–Schulz or the read or write of an update raised an exception (raised "
            f"there, with its traceback); {kept}"
        )
    if outcome.failed_rank is None and outcome.disagreement is not None:
        raise RuntimeError(
            f"muon_dist.Muon step {step}: the ranks disagree: {outcome.disagreement}; "
            "parameters and state were left as they were on every rank. Set options "
            "identically on every rank (a scheduler stepped on a rank's own loss, e.g. "
            "ReduceLROnPlateau, needs the loss averaged over ranks first)"
        )
    if outcome.failed_rank is not None:
        differs = (
            "" if outcome.disagreement is None else f"; the ranks disagree: {outcome.disagreement}"
        )
        raise RuntimeError(
            f"muon_dist.Muon step {step} failed on rank {outcome.failed_rank}, which "
            "refused its inputs (gradients or options) or whose closure raised, and "
            "raised that error there; parameters and state were left as they were on "
            f"every rank; fix that rank's inputs{differs}"
        )


def _reason(outcome: Outcome) -> str:
    """What was non-finite in a skipped or refused step."""
    if outcome.nonfinite_grads:
        return f"non-finite gradient in {', '.join(outcome.nonfinite_grads)}"
    if outcome.overflowing_grads:
        return (
            f"gradient norm too large in {', '.join(outcome.overflowing_grads)} (finite, "
            f"but above {NS_NORM_LIMIT:.2g}·(1 - momentum), where Newton–Schulz's "
            "normalisation would overflow fp32)"
        )
    return f"non-finite Newton–Schulz result for {', '.join(outcome.nonfinite_results)}"
