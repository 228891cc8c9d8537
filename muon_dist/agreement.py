"""Agreement on gradients, decided on the device, and the host's later view of its outcome.

Every rank must take the same decision about each parameter (is there a gradient on any
rank? is any gradient non-finite?), and the step must not wait for the device to learn
it. So the decision stays a device tensor: one small all-reduce among the ranks holding
the parameters (:mod:`muon_dist.groups`) builds per-parameter
flags, and the step turns them into a ``keep`` mask and a ``found_inf`` flag (as
``torch.amp.GradScaler`` does) that the update rule and fused AdamW read on the device.

The host reads the outcome later, from a host copy queued at the end of the step: on a
CUDA device, at the next point that needs it (the next ``step()``, ``state_dict()`` or
``check_finite()``), after waiting on an event recorded with that copy; with CPU tensors,
where the copy is already there, at the end of the step itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from muon_dist.groups import Peers
from muon_dist.step_scalars import StepInputs

# Per-parameter gradient verdicts; the all-reduce takes the worst (MAX) over ranks.
TOO_LARGE = 1.0  # finite, but its norm would overflow Newton–Schulz's normalisation
NONFINITE = 2.0  # a NaN or an infinity somewhere in it


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


class Agreement:
    """Device flags of one step: presence and finiteness per parameter, ``keep`` per Muon
    parameter, ``found_inf``, and the non-finite Newton–Schulz results per Muon parameter."""

    def __init__(
        self,
        names: Sequence[str],
        muon_positions: Sequence[int],
        device: torch.device,
        holders: Peers,
    ) -> None:
        count = len(names)
        self.names = list(names)
        self.muon_names = [self.names[i] for i in muon_positions]
        self.device = device
        self.holders = holders
        self.flags = torch.zeros(2 * count + 1, device=device)  # present | verdict | failed
        self.found_inf = torch.zeros((), device=device)  # exactly 1.0 when found
        self.keep = torch.zeros(len(muon_positions), dtype=torch.bool, device=device)
        self.keep_float = torch.zeros(len(muon_positions), device=device)
        # Result flags, all-reduced together: per Muon parameter its non-finite
        # Newton–Schulz results, and a rank whose own work of the step raised (rank + 1).
        self._results = torch.zeros(len(muon_positions) + 1, device=device)
        self.bad_results, self.crashed = self._results.split_with_sizes([len(muon_positions), 1])
        self._muon_index = torch.tensor(list(muon_positions), dtype=torch.long, device=device)
        # verdicts | non-finite results | crashed rank + 1 | failed rank + 1 | found_inf
        self._report = torch.zeros(count + len(muon_positions) + 3, device=device)
        pinned = device.type == "cuda"
        self._host = torch.zeros_like(self._report, device="cpu", pin_memory=pinned)
        # A numpy view of the host copy: reading it is a plain memory read, made once here.
        self._host_view = self._host.numpy() if pinned else self._report.numpy()
        self._event = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]
        self._pending: int | None = None  # step number whose report is queued, unread
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def _index(self, positions: tuple[int, ...]) -> torch.Tensor:
        """Positions of the present gradients as a device tensor, built once per pattern."""
        cached = self._indices.get(positions)
        if cached is None:
            cached = self._indices[positions] = torch.tensor(
                positions, dtype=torch.long, device=self.device
            )
        return cached

    def decide(
        self,
        grads: Sequence[torch.Tensor | None],
        inputs: StepInputs,
        *,
        keep_results: bool = False,
    ) -> None:
        """Fill the flags for this step's local gradients and agree on them over all ranks.

        ``inputs`` (staged by the caller) says per parameter whether it has a local
        gradient and the largest gradient norm Newton–Schulz can normalise (inf for AdamW),
        and this rank's failure (rank + 1, or 0). Norms are taken in fp64, so a finite
        gradient of any dtype has a finite norm, and an overflow of the normalisation is
        told apart from a non-finite entry. Zeroes the result flags, unless
        ``keep_results`` (a step whose buckets started before it, see :meth:`clear_results`).
        """
        count = len(self.names)
        verdict = self.flags[count : 2 * count]
        self.flags[:count].copy_(inputs.present)
        self.flags[-1:].copy_(inputs.failed)
        verdict.zero_()
        positions = tuple(i for i, g in enumerate(grads) if g is not None)
        if positions:
            index = self._index(positions)
            norms = torch.stack(
                torch._foreach_norm([g for g in grads if g is not None], 2, dtype=torch.float64)
            )
            limits = inputs.norm_limit.index_select(0, index).double()
            bad = torch.where(
                torch.isfinite(norms),
                (norms > limits).to(verdict.dtype) * TOO_LARGE,
                torch.full_like(norms, NONFINITE, dtype=verdict.dtype),
            )
            verdict.index_copy_(0, index, bad)
        if self.holders.size > 1:
            dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.holders.group)
        torch.amax(self.flags[count:], dim=0, out=self.found_inf)
        self.found_inf.clamp_(max=1.0)
        if not keep_results:
            self.clear_results()
        self._set_keep()

    def clear_results(self) -> None:
        """Zero the result flags before the step's first Newton–Schulz result."""
        self._results.zero_()

    def _set_keep(self) -> None:
        present = self.flags.index_select(0, self._muon_index)
        torch.logical_and(present > 0, self.found_inf == 0, out=self.keep)
        self.keep_float.copy_(self.keep)

    def count_bad_results(self, tensors: torch.Tensor, bad: torch.Tensor) -> None:
        """Add ``bad`` (1.0 per non-finite result) to the Muon parameters ``tensors`` name."""
        self.bad_results.index_add_(0, tensors, bad)

    def record_failure(self, rank: int, tensors: torch.Tensor) -> None:
        """Flag an exception of ``rank``'s own work on the Muon parameters ``tensors``: the
        other ranks learn of it in :meth:`agree_on_results` instead of waiting in a
        collective this rank never joins."""
        self.crashed.fill_(float(rank + 1))
        self._results.index_fill_(0, tensors, 1.0)

    def agree_on_results(self, skip: bool) -> None:
        """All-reduce the result flags; under ``skip`` they also set ``found_inf`` and
        clear ``keep``, so the still-pending writes leave everything alone."""
        if self.holders.size > 1:
            dist.all_reduce(self._results, op=dist.ReduceOp.MAX, group=self.holders.group)
        if skip:
            torch.maximum(self.found_inf, self._results.amax(), out=self.found_inf)
            self.found_inf.clamp_(max=1.0)
            self._set_keep()

    def publish(self) -> None:
        """Queue the host copy of this step's outcome (part of a captured step)."""
        count = len(self.names)
        report = self._report
        report[:count].copy_(self.flags[count : 2 * count])
        report[count:-2].copy_(self._results)
        report[-2:-1].copy_(self.flags[-1:])
        report[-1:].copy_(self.found_inf.view(1))
        if self._event is not None:
            self._host.copy_(report, non_blocking=True)

    def queued(self, step: int) -> None:
        """Mark the copy queued by :meth:`publish` as the outcome of ``step`` (host side)."""
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
        values = self._host_view
        count = len(self.names)
        if not values[-1] and not np.any(values[count:-2]):
            return None
        verdicts = values[:count]
        crashed = values[-3]
        return Outcome(
            step,
            tuple(n for n, v in zip(self.names, verdicts, strict=True) if v == NONFINITE),
            tuple(n for n, v in zip(self.muon_names, values[count:-3], strict=True) if v),
            tuple(n for n, v in zip(self.names, verdicts, strict=True) if v == TOO_LARGE),
            int(values[-2]) - 1 if values[-2] else None,
            int(crashed) - 1 if crashed else None,
        )
