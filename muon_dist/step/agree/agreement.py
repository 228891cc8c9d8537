"""Agreement on gradients, decided on the device.

Every rank must take the same decision about each parameter (is there a gradient on any
rank? is any gradient non-finite?), and the step must not wait for the device to learn
it. So the decision stays a device tensor: one small all-reduce among the ranks holding
the parameters (:mod:`muon_dist.comm.groups`) builds per-parameter
flags, and the step turns them into a ``keep`` mask and a ``found_inf`` flag (as
``torch.amp.GradScaler`` does) that the update rule and fused AdamW read on the device.

The same all-reduce agrees on what a scheduler or the user may change between steps: every
entry of every group travels as ``v`` and ``-v``, so the MAX gives its largest and smallest
value across ranks and a difference is named by its key (the step values and counts as
numbers, every other option as a digest of its ``repr``), and each rank puts a digest of
all its group options in a slot of its own, to group the ranks by their options; a
difference anywhere fails the step on every rank, as a non-finite gradient does. The
gradients of parameters every rank holds whole (replicas) are compared the same way, by
their norms: every rank applies the owner's update to a replica, so replicas need equal
gradients (the data-parallel wrapper averages them), and a difference fails the step.

The host reads the outcome later, from a copy queued at the end of the step
(:mod:`muon_dist.step.agree.report`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.comm.groups import Peers
from muon_dist.kernels.tables import tables_allowed
from muon_dist.options.schema import OPTIONS
from muon_dist.rules.forms import fused_launches
from muon_dist.step.agree.decisions import count_bad_, settle_
from muon_dist.step.agree.report import NONFINITE, TOO_LARGE, Compared, Report
from muon_dist.step.shard.scalars import Segments, StepInputs

# Group entries that are no option and are compared as numbers: the step counts.
_COUNTS = ("steps", "skipped_steps")
_BOOKKEEPING = ("params", "param_names", "algorithm", *_COUNTS)
# A digest takes 24 bits, which a float32 holds exactly.
_DIGEST_BITS = 0xFFFFFF


def _digest(text: str) -> float:
    return float((zlib.crc32(text.encode()) & _DIGEST_BITS) + 1)


def compared_entries(groups: Sequence[dict[str, Any]]) -> list[Compared]:
    """Every group entry the ranks compare at each step, in the order :func:`compared_values`
    returns them: per group its options (``betas`` as two numbers), its step counts and a
    digest of the keys no option declares (``initial_lr`` of a scheduler, the user's own)."""
    entries: list[Compared] = []
    for index, group in enumerate(groups):
        where = f"param group {index}"
        for option in OPTIONS[group["algorithm"]]:
            if option.key == "betas":
                entries += [Compared(f"{where} betas[{i}]", "betas", index, True) for i in (0, 1)]
            else:
                entries.append(
                    Compared(f"{where} {option.key}", option.key, index, option.per_step)
                )
        entries += [Compared(f"{where} {key}", key, index, True) for key in _COUNTS]
        entries.append(Compared(f"{where} keys no option declares", "", index, False))
    return entries


def compared_values(
    groups: Sequence[dict[str, Any]], entries: Sequence[Compared]
) -> tuple[list[float], list[str]]:
    """The values of ``entries`` in ``groups`` (options already checked), and each as text."""
    values: list[float] = []
    shown: list[str] = []
    for entry in entries:
        group = groups[entry.group]
        if entry.key == "betas":
            value: Any = group["betas"][int(entry.label[-2])]
        elif entry.key:
            value = group[entry.key]
        else:
            known = {o.key for o in OPTIONS[group["algorithm"]]}
            value = {k: v for k, v in group.items() if k not in known and k not in _BOOKKEEPING}
        text = repr(value)
        values.append(float(value) if entry.numeric else _digest(text))
        shown.append(text)
    return values, shown


class GroupEntries:
    """Every group entry the ranks compare (:func:`compared_entries`), and its value and
    text as last read. A read of groups that hold what the last read saw, the ``per_step``
    keys aside, reads again only the entries of those keys and the keys no option declares
    (schedulers' bookkeeping among them)."""

    def __init__(self, entries: Sequence[Compared], per_step: Collection[str]) -> None:
        self.entries = list(entries)
        self._volatile = [i for i, e in enumerate(self.entries) if e.key in per_step or not e.key]
        self._volatile_entries = [self.entries[i] for i in self._volatile]
        self._last: tuple[list[float], list[str]] | None = None

    def read(
        self, groups: Sequence[dict[str, Any]], unchanged: bool
    ) -> tuple[list[float], list[str]]:
        """The entries' values and texts (:func:`compared_values`); ``unchanged``: the
        groups hold what the last read saw, the ``per_step`` keys aside."""
        if unchanged and self._last is not None:
            values, shown = list(self._last[0]), list(self._last[1])
            fresh = compared_values(groups, self._volatile_entries)
            for i, value, text in zip(self._volatile, *fresh, strict=True):
                values[i], shown[i] = value, text
        else:
            values, shown = compared_values(groups, self.entries)
        self._last = (values, shown)
        return values, shown


class Agreement:
    """Device flags of one step: presence and finiteness per parameter, ``keep`` per Muon
    parameter, ``found_inf``, the non-finite Newton–Schulz results per Muon parameter, and
    the ranks' agreement on step values, options and replicas' gradients. ``backend``: the
    optimizer's; where it allows Triton on CUDA, the gradients' norms and the decisions
    taken from the flags run as fused launches."""

    def __init__(
        self,
        names: Sequence[str],
        muon_positions: Sequence[int],
        device: torch.device,
        holders: Peers,
        groups: Sequence[dict[str, Any]],
        replicated: Sequence[int],
        per_step: Collection[str] = (),
        backend: str = "torch",
    ) -> None:
        count = len(names)
        self.device = device
        self.holders = holders
        # Compared across ranks only where there are several: the step values, one digest
        # slot per rank, and the gradients of the parameters at ``replicated`` positions.
        several = holders.size > 1
        self.group_entries = GroupEntries(compared_entries(groups) if several else [], per_step)
        self.replicated = list(replicated) if several else []
        self._replicated_slot = {p: j for j, p in enumerate(self.replicated)}
        slots = holders.size if several else 0
        k, r = len(self.group_entries.entries), len(self.replicated)
        # The flags compared across ranks. The host stages ``values`` to ``digests`` (the
        # step values, negated, and one options digest slot per rank).
        self._compared_layout = Segments.of(
            values=k, negated=k, digests=slots, norms=r, negated_norms=r
        )
        # Every device flag of a step in one buffer, which the report copies to the host
        # whole. ``present`` to ``compared`` are all-reduced (MAX) by :meth:`decide`,
        # ``verdict`` to ``failed`` decide found_inf; the result flags (per Muon parameter
        # its non-finite Newton–Schulz results, and a rank whose own work of the step
        # raised: rank + 1) by :meth:`agree_on_results`.
        self._layout = Segments.of(
            present=count,  # 1.0 where a rank has the gradient
            verdict=count,  # TOO_LARGE or NONFINITE per gradient
            failed=1,  # a rank that refused its inputs: rank + 1
            redo=1,  # 1.0 where a rank's buckets started early must start again (backward.py)
            compared=self._compared_layout.numel,
            bad_results=len(muon_positions),
            crashed=1,
            found_inf=1,  # exactly 1.0 when found
        )
        self.flags = torch.zeros(self._layout.numel, device=device)
        self._flag = self._layout.views(self.flags)
        self._decided = self.flags[self._layout.bounds("present", "compared")]
        compared = self._flag["compared"]
        self._compare = self._compared_layout.views(compared)
        self.stage_size = 2 * k + slots
        self.found_inf = self._flag["found_inf"].view(())
        self._differs = torch.zeros((), dtype=torch.bool, device=device)
        self.keep = torch.zeros(len(muon_positions), dtype=torch.bool, device=device)
        self._results = self.flags[self._layout.bounds("bad_results", "crashed")]
        # What a step's outcome sets found_inf from: after the agreement, and after the
        # results' agreement (with found_inf itself).
        self._checked = self.flags[self._layout.bounds("verdict", "failed")]
        self._results_and_found = self.flags[self._layout.bounds("bad_results", "found_inf")]
        self._muon_index = torch.tensor(list(muon_positions), dtype=torch.long, device=device)
        self._staged = compared[self._compared_layout.bounds("values", "digests")]
        # The decisions taken from the flags take their one-launch forms (decisions.py).
        self._fused_flags = fused_launches(backend, self.flags)
        self.report = Report(
            list(names),
            [names[i] for i in muon_positions],
            self.group_entries.entries,
            [names[i] for i in self.replicated],
            holders.ranks,
            self._compared_layout,
            self._layout,
            self.flags,
        )
        self._indices: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def present(self) -> torch.Tensor:
        """Per parameter, after :meth:`decide`: > 0 where some rank has its gradient."""
        return self._flag["present"]

    def stage(self, groups: Sequence[dict[str, Any]], rank: int, unchanged: bool) -> list[float]:
        """What this rank stages for the comparison: its group entries, negated, and its
        digest in its own slot (the others 0); empty on one rank. ``unchanged``: the groups
        hold what the last call read, the ``per_step`` keys aside, so only the entries
        those keys can change are read again."""
        if not self.stage_size:
            return []
        values, self.report.shown = self.group_entries.read(groups, unchanged)
        digests = [0.0] * self.holders.size
        # Every entry's text: a digest of all the group options and step counts.
        digests[self.holders.index(rank)] = _digest("\n".join(self.report.shown))
        return values + [-v for v in values] + digests

    def _index(self, positions: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions of the present gradients as a device tensor, and which of those are
        replicated (their norms' rows, then their slots), built once per pattern."""
        cached = self._indices.get(positions)
        if cached is None:
            rows = [i for i, p in enumerate(positions) if p in self._replicated_slot]
            pairs = None
            if rows:
                slots = [self._replicated_slot[positions[i]] for i in rows]
                pairs = torch.tensor([rows, slots], dtype=torch.long, device=self.device)
            cached = self._indices[positions] = (
                torch.tensor(positions, dtype=torch.long, device=self.device),
                pairs,
            )
        return cached

    def decide(
        self,
        grads: Sequence[torch.Tensor | None],
        inputs: StepInputs,
        redo: torch.Tensor | None = None,
    ) -> None:
        """Fill the flags for this step's local gradients and agree on them over all ranks.

        ``inputs`` (staged by the caller) says per parameter whether it has a local
        gradient and the largest gradient norm Newton–Schulz can normalise (inf for AdamW),
        this rank's failure (rank + 1, or 0), and what :meth:`stage` returned. Norms are
        taken in fp64, so a finite gradient of any dtype has a finite norm, and an overflow of the
        normalisation is told apart from a non-finite entry. The result flags are the Muon
        phase's: its program clears them before its first Newton–Schulz result
        (:meth:`clear_results`), which a step started during backward had before this.
        ``redo`` (one element, > 0) asks every rank to start those buckets again
        (:meth:`redo_asked`).
        """
        flag, compare = self._flag, self._compare
        flag["present"].copy_(inputs.present)
        flag["failed"].copy_(inputs.failed)
        if redo is None:
            flag["redo"].zero_()
        else:
            flag["redo"].copy_(redo.view(1))
        self._staged.copy_(inputs.compared)
        flag["verdict"].zero_()
        compare["norms"].fill_(-math.inf)
        compare["negated_norms"].fill_(-math.inf)
        self._flag_grads(grads, inputs)
        if self.holders.size > 1:
            dist.all_reduce(self._decided, op=dist.ReduceOp.MAX, group=self.holders.group)
        compared = self._compared_layout.numel > 0
        settle_(
            self._checked,
            flag["present"],
            self._muon_index,
            self.found_inf,
            self.keep,
            compare if compared else None,
            self._differs if compared else None,
            fused=self._fused_flags,
        )

    def _flag_grads(self, grads: Sequence[torch.Tensor | None], inputs: StepInputs) -> None:
        """This rank's verdict on each local gradient (non-finite, or above its norm limit)
        and, for replicas, its norm to compare across ranks."""
        flag, compare = self._flag, self._compare
        present = [g for g in grads if g is not None]
        if present:
            positions = tuple(range(len(grads)))  # no Python step per gradient
            if len(present) < len(grads):
                positions = tuple([i for i, g in enumerate(grads) if g is not None])
            index, replicated = self._index(positions)
            if self._fused(present):
                from muon_dist.kernels.triton_reduce import norm_verdicts_triton

                norms = norm_verdicts_triton(
                    present, index, inputs.norm_limit, flag["verdict"], TOO_LARGE, NONFINITE
                )
            else:
                norms = torch.stack(torch._foreach_norm(present, 2, dtype=torch.float64))
                limits = inputs.norm_limit.index_select(0, index).double()
                bad = torch.where(
                    torch.isfinite(norms),
                    (norms > limits).to(self.flags.dtype) * TOO_LARGE,
                    torch.full_like(norms, NONFINITE, dtype=self.flags.dtype),
                )
                flag["verdict"].index_copy_(0, index, bad)
            if replicated is not None:
                finite = torch.isfinite(norms)
                mine = torch.where(finite, norms, -math.inf).index_select(0, replicated[0])
                compare["norms"].index_copy_(0, replicated[1], mine.to(self.flags.dtype))
                compare["negated_norms"].index_copy_(0, replicated[1], (-mine).to(self.flags.dtype))

    def _fused(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether the gradients' norms and verdicts take the fused Triton form: under a
        backend that allows it, on CUDA, every gradient contiguous in a dtype it reads."""
        if not (self._fused_flags and tables_allowed(self.device)):
            return False
        from muon_dist.kernels.triton_reduce import TL_DTYPES  # imports Triton

        return all(g.is_contiguous() and g.dtype in TL_DTYPES for g in grads)

    def ranks_differ(self) -> bool:
        """Whether the ranks' options differed in the last :meth:`decide`: a host read, made
        only on the first step of a rebuilt plan, before its collectives."""
        return bool(self._differs.item())

    def redo_asked(self) -> bool:
        """Whether a rank asked, in the last :meth:`decide`, to start early buckets again:
        a host read, made once per step under ``overlap="backward"``."""
        return bool(self._flag["redo"].item())

    def refuse_all(self) -> None:
        """Keep nothing in a step whose flags this agreement did not decide (see
        :meth:`muon_dist.step.runner.StepRunner.mirror`)."""
        self.found_inf.fill_(1.0)
        self.keep.zero_()

    def clear_results(self) -> None:
        """Zero the result flags before the step's first Newton–Schulz result."""
        self._results.zero_()

    def count_bad_results(
        self, sums: torch.Tensor, tensors: torch.Tensor, dropped: torch.Tensor | None = None
    ) -> None:
        """Count, per Muon parameter, its matrices whose Newton–Schulz result is not finite:
        those whose fp32 ``sums`` are not, leaving out the ones ``dropped`` marks where
        given; ``tensors`` names each matrix's Muon parameter."""
        count_bad_(sums, tensors, self._flag["bad_results"], dropped, fused=self._fused_flags)

    def record_failure(self, rank: int, tensors: torch.Tensor) -> None:
        """Flag an exception of ``rank``'s own work on the Muon parameters ``tensors``: the
        other ranks learn of it in :meth:`agree_on_results` instead of waiting in a
        collective this rank never joins."""
        self._flag["crashed"].fill_(float(rank + 1))
        self._flag["bad_results"].index_fill_(0, tensors, 1.0)

    def agree_on_results(self) -> None:
        """All-reduce the result flags."""
        if self.holders.size > 1:
            dist.all_reduce(self._results, op=dist.ReduceOp.MAX, group=self.holders.group)

    def skip_on_results(self) -> None:
        """A transactional step: the agreed result flags also set ``found_inf`` and clear
        ``keep``, so the still-pending writes leave everything alone."""
        settle_(
            self._results_and_found,
            self._flag["present"],
            self._muon_index,
            self.found_inf,
            self.keep,
            fused=self._fused_flags,
        )

    def publish(self) -> None:
        """Queue the host copy of this step's outcome (part of a captured step)."""
        self.report.copy()
