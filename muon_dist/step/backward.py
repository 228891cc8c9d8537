"""The Muon phase started during backward (``Muon(..., overlap="backward")``, and the
steps ``overlap="auto"`` overlaps, :mod:`muon_dist.step.overlap_choice`).

FSDP2 calls each sharded parameter's post-accumulate-grad hooks right after its gradient's
reduce-scatter (and, under HSDP, all-reduce), in ``foreach_reduce``. From there a bucket
whose every tensor has its final gradient starts: its momentum and Newton–Schulz input,
gather, Newton–Schulz and scatter run while backward goes on. ``step()`` starts the
buckets no hook started, waits for all, agrees on the gradients and results, and only then
writes the parameters and commits the momenta (:meth:`MuonPhase.close_early`), so a
non-finite gradient anywhere still leaves everything as it was on every rank.

Every rank issues the same collectives in the same order: buckets start strictly in plan
order (the plan orders them last view first, the order backward finishes gradients), one
pipeline round per bucket, whatever the moment a hook fires; the exchanges run on a process
group of their own (:func:`muon_dist.comm.groups.dedicated`), so they never interleave with
FSDP's collectives on its communicator. On CUDA the work runs on a side stream that waits
for the stream the hook runs on (where the gradient was reduced); ``step()`` waits for it.

A gradient reported twice before ``step()`` (micro-batches that each reduce, without
``set_requires_gradient_sync(False)``) restarts the step from that hook: the started
buckets finish and their results are dropped. The same happens at ``step()``, on every rank
(the ranks agree on it in the step's all-reduce), where what the started buckets read
changed after its hook on any rank: a gradient whose norm changed (``clip_grad_norm_``, a
scaling, ``zero_grad(set_to_none=False)``, a later hook that edits it), a gradient replaced
by another tensor, or a group's ``momentum`` or ``nesterov``. The result is then the plain
step's, and the overlap saved nothing: change gradients and those values before backward
ends to keep it. (The lr and weight decay are read at ``step()``; any other option change
rebuilds the step, :mod:`muon_dist.step.changes`.)
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
from muon_dist.step.muon_phase import MuonPhase
from muon_dist.step.scalars import StepInputs

logger = logging.getLogger(__name__)

# The step values the started buckets read (the lr and weight decay wait for step()).
_READ_EARLY = tuple(
    o.key for o in MUON_OPTIONS if o.per_step and o.key not in ("lr", "weight_decay")
)


def _fp64_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp64 norms a hook records and ``step()`` compares, from one kernel for both: on
    CUDA, ``vector_norm`` and ``_foreach_norm`` sum in different orders, so a norm taken
    by each differs in its last bits and every overlapped step would be redone."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))


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
    """Starts a Muon phase's buckets from gradient hooks and finishes the step."""

    def __init__(self, phase: MuonPhase, names: Sequence[str]) -> None:
        self.phase = phase
        self.names = list(names)  # per Muon tensor
        # Per bucket, in plan order, the Muon tensors it needs (the same on every rank).
        self._needs = [
            frozenset(phase.entries[v].tensor_index for v in bucket.views)
            for bucket in phase.plan.buckets
        ]
        # This step's reported tensors and the gradients read. Their fp64 norms at their
        # hooks, compared at step(): in-place edits of a DTensor gradient bump no version
        # counter of its local tensor, and FSDP's own writes to its neighbours do.
        self._reported: dict[int, torch.Tensor] = {}
        self._norms = torch.zeros(len(names), dtype=torch.float64, device=phase.device)
        self._groups = list({id(e.group): e.group for e in phase.entries}.values())
        self._read_early: list[tuple[Any, ...]] = []  # _READ_EARLY per group at the first hook
        self._callback_queued = False
        self._open = False
        self.restarts = 0  # steps restarted by a gradient reported twice
        self.redone = 0  # steps whose started buckets ran again at step() (changed())
        self.held_bytes = 0  # updates held for step() at the end of the last backward
        # The open step's pipeline, and how many buckets, in plan order, it has started.
        self._pipeline = Pipeline(phase.settings.max_inflight)
        self._started = 0
        device = phase.device
        cuda = device.type == "cuda"
        self.stream = side_stream(device, "backward overlap") if cuda else None

    @property
    def started(self) -> int:
        """Buckets started so far in the open step."""
        return self._started if self._open else 0

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """On CUDA, run on the side stream after the current stream's work so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def report(self, j: int, grad: torch.Tensor) -> None:
        """Muon tensor ``j``'s local gradient is final: start every bucket, in plan order,
        whose tensors all are. Labelled ``muon_dist.grad_hook`` in profiles (the host time
        a hook adds to backward)."""
        with torch.profiler.record_function("muon_dist.grad_hook"):
            self._report(j, grad)

    def _report(self, j: int, grad: torch.Tensor) -> None:
        self._norms[j].copy_(_fp64_norms([grad])[0])
        with self._side_stream():
            if j in self._reported:
                self.restarts += 1
                if self.restarts == 1:
                    logger.info(
                        "muon_dist: a step overlapping backward: %s got a second gradient before "
                        "step(); the started buckets are dropped and begin again. Accumulate "
                        "with model.set_requires_gradient_sync(False) on all but the last "
                        "micro-batch so nothing starts early for nothing",
                        self.names[j],
                    )
                self._drop()  # their gradients changed
            if not self._open:
                self._begin()
            self._reported[j] = grad
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.phase.grads.set_one(j, grad)
            needs, reported = self._needs, self._reported.keys()
            while self._started < len(needs) and needs[self._started] <= reported:
                self._start_next()

    def _begin(self) -> None:
        self._read_early = [tuple(g[k] for k in _READ_EARLY) for g in self._groups]
        self.phase.open_early()
        self._pipeline = Pipeline(self.phase.settings.max_inflight)
        self._started = 0
        self._open = True

    def _start_next(self) -> None:
        """Start the next bucket in plan order: one pipeline round, as ``run_tasks`` makes
        per bucket, so the collectives are the plain step's, in its order."""
        self._pipeline.add(self.phase.bucket(self._started))
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

    def abandon(self) -> None:
        """Drop the open step: the step was rebuilt and the new one starts every bucket, or
        this step runs plain (``overlap="auto"``) on the same buffers, after the drop."""
        if self._open:
            with self._side_stream():
                self._drop()
            self._join()

    def _join(self) -> None:
        """On CUDA, make the current stream wait for the side stream's work so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def changed(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """Whether what the started buckets read changed since the hooks (see the module's
        docstring), as a device flag for the step's agreement; None where none started
        (also where no hook ran since the last step: a step() again without backward)."""
        if not self.started:
            return None
        reported = list(self._reported)
        now = [self._reported[j] for j in reported]
        values = [tuple(g[k] for k in _READ_EARLY) for g in self._groups]
        if values != self._read_early or any(
            grads[j] is not g for j, g in zip(reported, now, strict=True)
        ):
            return torch.ones((), device=self._norms.device)
        norms = torch.stack(_fp64_norms(now))
        index = torch.tensor(reported, device=self._norms.device)
        return (norms != self._norms.index_select(0, index)).any().float()

    def finish(
        self,
        grads: Sequence[torch.Tensor | None],
        inputs: StepInputs,
        *,
        transactional: bool,
        redo: bool = False,
    ) -> None:
        """Finish the step after the agreement: start the buckets no hook started (all of
        them again where ``redo``), wait for all, then commit where kept (see
        :meth:`MuonPhase.close_early`)."""
        with self._side_stream():
            if redo and self._open:
                self.redone += 1
                self._drop()
            if not self._open:
                self._begin()
            try:
                self.phase.set_grads(grads)
                while self._started < len(self._needs):
                    self._start_next()
                self._pipeline.finish()
                self.phase.close_early(inputs, transactional=transactional)
            finally:
                self._open = False
                self._reported.clear()
        self._join()
