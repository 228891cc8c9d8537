"""The Muon phase started during backward (``Muon(..., overlap="backward")``, and the
steps ``overlap="auto"`` overlaps, :mod:`muon_dist.step.launch.overlap_choice`).

FSDP2 calls each sharded parameter's post-accumulate-grad hooks right after its gradient's
reduce-scatter (and, under HSDP, all-reduce), in ``foreach_reduce``. From there a bucket
whose every tensor has its final gradient starts: its momentum and Newton–Schulz input,
gather, Newton–Schulz and scatter run while backward goes on. ``step()`` starts the
buckets no hook started, waits for all, agrees on the gradients and results, and only then
writes the parameters and commits the momenta (:meth:`StepProgram.close`), so a
non-finite gradient anywhere still leaves everything as it was on every rank.

Every rank issues the same collectives in the same order: buckets start strictly in plan
order (the plan orders them last view first, the order backward finishes gradients), one
pipeline round per bucket, whatever the moment a hook fires; the exchanges run on a process
group of their own (:func:`muon_dist.comm.groups.dedicated`), so they never interleave with
FSDP's collectives on its communicator. A hook that starts no bucket only takes note of its
gradient, on the host, so that it delays backward's own launches as little as it can. On
CUDA the buckets run on a side stream that, as a hook starts them, waits for the streams
the hooks ran on since it last waited (where their gradients were reduced); ``step()``
waits for it.

A gradient reported twice before ``step()`` (micro-batches that each reduce, without
``set_requires_gradient_sync(False)``) restarts the step from that hook: the started
buckets finish and their results are dropped. The same happens at ``step()``, on every rank
(the ranks agree on it in the step's all-reduce), where what the started buckets read
changed after they started on any rank: a gradient whose norm changed (``clip_grad_norm_``,
a scaling, ``zero_grad(set_to_none=False)``, a later hook that edits it), a gradient
replaced by another tensor, or a group's ``momentum`` or ``nesterov``. The result is then
the plain step's, and the overlap saved nothing: change gradients and those values before
backward ends to keep it. (The lr and weight decay are read at ``step()``; any other option
change rebuilds the step, :mod:`muon_dist.step.changes`.)

Only what the started buckets read is compared: the fp64 norms of the gradients that the
buckets a hook starts are the first to read, taken together as they start (an edit
made before is read by the bucket, not missed), against their norms at ``step()``. A
gradient whose bucket did not start during backward is read at ``step()``, so it cannot
have been read stale and is not compared.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from muon_dist.kernels.streams import side_stream
from muon_dist.options.schema import MUON_OPTIONS
from muon_dist.runtime import Pipeline
from muon_dist.step.program.muon_phase import MuonPhase, StepProgram

logger = logging.getLogger(__name__)

# The step values the started buckets read (the lr and weight decay wait for step()).
_READ_EARLY = tuple(
    o.key for o in MUON_OPTIONS if o.per_step and o.key not in ("lr", "weight_decay")
)


def _fp64_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp64 norms the started buckets record and ``step()`` compares, from one kernel
    for both: on CUDA, ``vector_norm`` and ``_foreach_norm`` sum in different orders, so a
    norm taken by each differs in its last bits and every overlapped step would be redone.

    ``_foreach_norm`` sums each tensor alone, chunk by chunk from its own start, so a norm
    does not depend on the other tensors of its list, but its fast kernel serves a list only
    where all its tensors share a dtype and are dense, and otherwise it takes each norm with
    ``vector_norm``. So the contiguous tensors of each dtype go together, and any other
    tensor alone: a tensor's norm is then the same whichever tensors it is taken with."""
    lists: dict[tuple[torch.dtype, int], list[int]] = {}
    for i, t in enumerate(tensors):
        lists.setdefault((t.dtype, -1 if t.is_contiguous() else i), []).append(i)
    norms: dict[int, torch.Tensor] = {}
    for members in lists.values():
        listed = torch._foreach_norm([tensors[i] for i in members], 2, dtype=torch.float64)
        norms.update(zip(members, listed, strict=True))
    return [norms[i] for i in range(len(tensors))]


def _first_reads(needs: Sequence[frozenset[int]]) -> tuple[list[int], list[int]]:
    """The Muon tensors in the order the buckets, in plan order, first need them, and the
    offsets that cut it per bucket: buckets ``0..k-1`` read exactly ``order[:offsets[k]]``.
    Buckets start in plan order, so the norms of the gradients the started ones read fill
    a prefix of this order, one slice per hook that starts buckets."""
    order: list[int] = []
    offsets = [0]
    seen: set[int] = set()
    for need in needs:
        fresh = sorted(need - seen)
        seen.update(fresh)
        order.extend(fresh)
        offsets.append(len(order))
    return order, offsets


def register_grad_hooks(
    params: Sequence[torch.Tensor], ready: Callable[[torch.Tensor], None]
) -> None:
    """Call ``ready(p)`` from each parameter's post-accumulate-grad hook, through a weak
    reference (a bound method's owner), so the hooks do not keep the optimizer alive."""
    method = weakref.WeakMethod(ready)

    def hook(p: torch.Tensor) -> None:
        target = method()
        if target is not None:
            target(p)

    for p in params:
        # A frozen parameter has no gradient, hence no hook: its bucket starts at step(), as
        # the buckets of parameters without a gradient do.
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]


class BackwardStart:
    """Starts a Muon phase's buckets from gradient hooks and finishes the step.

    A hook that starts no bucket only takes note of its gradient, on the host: it makes no
    device work and waits on no stream, so it delays backward's own launches as little as
    it can. A hook that starts buckets records the norms of the gradients they are the
    first to read, in one kernel, then starts them on the side stream."""

    def __init__(self, phase: MuonPhase, names: Sequence[str], program: StepProgram) -> None:
        self.phase = phase
        self.program = program  # the early mode's (StepMode.EARLY[_TRANSACTIONAL])
        self.names = list(names)  # per Muon tensor
        # Per bucket, in plan order, the Muon tensors it needs (the same on every rank).
        self._needs = [
            frozenset(phase.tensors.entries[v].tensor_index for v in bucket.views)
            for bucket in phase.plan.buckets
        ]
        # This step's reported tensors and the gradients read.
        self._reported: dict[int, torch.Tensor] = {}
        # The fp64 norms of the gradients the started buckets read, in _order, taken as each
        # bucket starts and compared at step(): in-place edits of a DTensor gradient bump no
        # version counter of its local tensor, and FSDP's own writes to its neighbours do.
        self._order, self._offsets = _first_reads(self._needs)
        device = phase.tensors.device
        self._norms = torch.zeros(len(self._order), dtype=torch.float64, device=device)
        self._groups = list({id(e.group): e.group for e in phase.tensors.entries}.values())
        self._read_early: list[tuple[Any, ...]] = []  # _READ_EARLY per group at the first start
        self._callback_queued = False
        self._open = False
        self.restarts = 0  # steps restarted by a gradient reported twice
        self.redone = 0  # steps whose started buckets ran again at step() (changed())
        self.held_bytes = 0  # updates held for step() at the end of the last backward
        # The open step's pipeline, and how many buckets, in plan order, it has started.
        self._pipeline = Pipeline(phase.settings.max_inflight)
        self._started = 0
        cuda = device.type == "cuda"
        self.stream = side_stream(device, "backward overlap") if cuda else None
        # The streams hooks ran on since the side stream last waited (their gradients were
        # made there): FSDP2 runs hooks on its reduce-scatter or all-reduce stream, a
        # parameter outside FSDP on backward's.
        self._hook_streams: set[torch.cuda.Stream] = set()

    @property
    def started(self) -> int:
        """Buckets started so far in the open step."""
        return self._started if self._open else 0

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """On CUDA, run on the side stream after the work so far of the current stream and
        of the streams the hooks ran on."""
        if self.stream is None:
            yield
            return
        self._hook_streams.add(torch.cuda.current_stream(self.stream.device))
        for stream in self._hook_streams:
            self.stream.wait_stream(stream)
        self._hook_streams.clear()
        with torch.cuda.stream(self.stream):
            yield

    def report(self, j: int, grad: torch.Tensor) -> None:
        """Muon tensor ``j``'s local gradient is final: start every bucket, in plan order,
        whose tensors all are. Labelled ``muon_dist.grad_hook`` in profiles (the host time
        a hook adds to backward); the label is left out while no profiler runs, where it
        would cost about as much as a launch."""
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function("muon_dist.grad_hook"):
                self._report(j, grad)
        else:
            self._report(j, grad)

    def _report(self, j: int, grad: torch.Tensor) -> None:
        if j in self._reported:
            self._restart(j)
        self._reported[j] = grad
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.phase.pieces.grads.set_one(j, grad)
        if self.stream is not None:
            self._hook_streams.add(torch.cuda.current_stream(self.stream.device))
        ready = self._ready()
        if ready > self.started:
            self._start_early(ready)

    def _restart(self, j: int) -> None:
        """Tensor ``j`` got a second gradient: drop what the first ones started."""
        self.restarts += 1
        if self.restarts == 1:
            logger.info(
                "muon_dist: a step overlapping backward: %s got a second gradient before "
                "step(); the started buckets are dropped and begin again. Accumulate "
                "with model.set_requires_gradient_sync(False) on all but the last "
                "micro-batch so nothing starts early for nothing",
                self.names[j],
            )
        self._forget()

    def _ready(self) -> int:
        """How many buckets, in plan order, have all their tensors reported."""
        count, needs, reported = self.started, self._needs, self._reported.keys()
        while count < len(needs) and needs[count] <= reported:
            count += 1
        return count

    def _start_early(self, ready: int) -> None:
        """Start the buckets up to ``ready`` from a hook: first record the norms of the
        gradients they are the first to read (on the hook's stream, before they read them),
        then start each in turn on the side stream."""
        low, high = self._offsets[self.started], self._offsets[ready]
        if low < high:
            grads = [self._reported[j] for j in self._order[low:high]]
            torch.stack(_fp64_norms(grads), out=self._norms[low:high])
        with self._side_stream():
            if not self._open:
                self._begin()
            while self._started < ready:
                self._start_next()

    def _begin(self) -> None:
        self._read_early = [tuple(g[k] for k in _READ_EARLY) for g in self._groups]
        self.program.open()
        self._pipeline = Pipeline(self.phase.settings.max_inflight)
        self._started = 0
        self._open = True

    def _start_next(self) -> None:
        """Start the next bucket in plan order: one pipeline round, as ``run_tasks`` makes
        per bucket, so the collectives are the plain step's, in its order."""
        self._pipeline.add(self.program.bucket(self._started))
        self._started += 1
        self._pipeline.round()

    def _backward_done(self) -> None:
        self._callback_queued = False
        self.held_bytes = self.phase.transaction.held_bytes()

    def _drop(self) -> None:
        """Let the started buckets finish (the other ranks run their collectives too) and
        drop their results."""
        self._pipeline.finish()
        self.phase.transaction.end()
        self._open = False
        self._reported.clear()

    def _forget(self) -> None:
        """Drop what the open step started, if anything, and forget its gradients."""
        if self._open:
            with self._side_stream():
                self._drop()
        self._reported.clear()

    def abandon(self) -> None:
        """Drop the open step: the step was rebuilt and the new one starts every bucket, or
        this step runs plain (``overlap="auto"``) on the same buffers, after the drop."""
        opened = self._open
        self._forget()
        if opened:
            self._join()

    def _join(self) -> None:
        """On CUDA, make the current stream wait for the side stream's work so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def changed(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """Whether what the started buckets read changed since they started (see the
        module's docstring), as a device flag for the step's agreement; None where none
        started (also where no hook ran since the last step: a step() again without
        backward). A gradient no started bucket reads is read at step() anyway."""
        if not self.started:
            return None
        count = self._offsets[self._started]
        read = self._order[:count]
        then = [self._reported[j] for j in read]
        values = [tuple(g[k] for k in _READ_EARLY) for g in self._groups]
        if values != self._read_early or any(
            grads[j] is not g for j, g in zip(read, then, strict=True)
        ):
            return torch.ones((), device=self._norms.device)
        norms = torch.stack(_fp64_norms(then))
        return (norms != self._norms[:count]).any().float()

    def redo(self) -> None:
        """Drop the started buckets, at ``step()``: a rank asked that every rank start them
        again (:meth:`changed`); :meth:`finish` starts them all."""
        if self._open:
            with self._side_stream():
                self.redone += 1
                self._drop()

    def finish(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Finish the step after the agreement: start the buckets no hook started, wait for
        all, then close the step by its program (agreement on the results, the commit where
        kept: :meth:`StepProgram.close`)."""
        with self._side_stream():
            if not self._open:
                self._begin()
            try:
                self.phase.set_grads(grads)
                while self._started < len(self._needs):
                    self._start_next()
                self._pipeline.finish()
                self.program.close()
            finally:
                self._open = False
                self._reported.clear()
        self._join()
