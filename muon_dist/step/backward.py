"""The Muon phase started during backward (``Muon(..., overlap="backward")``).

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
group of their own (:func:`muon_dist.dist.groups.dedicated`), so they never interleave with
FSDP's collectives on its communicator. On CUDA the work runs on a side stream that waits
for the stream the hook runs on (where the gradient was reduced); ``step()`` waits for it.

A gradient reported twice before ``step()`` (micro-batches that each reduce, without
``set_requires_gradient_sync(False)``) restarts the step from that hook: the started
buckets finish and their results are dropped. A gradient changed in place after its hook
(``clip_grad_norm_`` between backward and step) is refused at ``step()`` on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from muon_dist.runtime import Pipeline
from muon_dist.step.muon_phase import MuonPhase
from muon_dist.step.scalars import StepInputs

logger = logging.getLogger(__name__)


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
        # This step's reported tensors: the gradient read, and its version at the end of
        # the backward that reported it (a gradient's version counter is its reduce
        # buffer's, which FSDP's later accumulations into its neighbours also bump).
        self._reported: dict[int, tuple[torch.Tensor, int]] = {}
        self._versions_queued = False
        self._open = False
        self.restarts = 0  # steps restarted by a gradient reported twice
        self.held_bytes = 0  # updates held for step() at the end of the last backward
        # The open step's pipeline, and how many buckets, in plan order, it has started.
        self._pipeline = Pipeline(phase.settings.max_inflight)
        self._started = 0
        device = phase.device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]

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
        whose tensors all are."""
        with self._side_stream():
            if j in self._reported:
                self.restarts += 1
                if self.restarts == 1:
                    logger.info(
                        "muon_dist: overlap='backward': %s got a second gradient before "
                        "step(); the started buckets are dropped and begin again. Accumulate "
                        "with model.set_requires_gradient_sync(False) on all but the last "
                        "micro-batch so nothing starts early for nothing",
                        self.names[j],
                    )
                self._pipeline.finish()  # the results are dropped: their gradients changed
                self.phase.transaction.end()
                self._open = False
                self._reported.clear()
            if not self._open:
                self._begin()
            self._reported[j] = (grad, grad._version)
            if not self._versions_queued:
                self._versions_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.phase.grads.set_one(j, grad)
            needs, reported = self._needs, self._reported.keys()
            while self._started < len(needs) and needs[self._started] <= reported:
                self._start_next()

    def _begin(self) -> None:
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
        """Record the reported gradients' versions once backward (and FSDP's own
        accumulation into their reduce buffers) is done."""
        self._versions_queued = False
        self._reported = {j: (grad, grad._version) for j, (grad, _) in self._reported.items()}
        self.held_bytes = self.phase.transaction.held_bytes()

    def check(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Refuse gradients that are not the ones the hooks started from."""
        for j, (grad, version) in self._reported.items():
            if grads[j] is not grad or grad._version != version:
                raise RuntimeError(
                    f"overlap='backward': the gradient of {self.names[j]} changed after "
                    "backward reduced it, when its Newton-Schulz had already started (an "
                    "in-place clip_grad_norm_ or scaling between backward and step(), or "
                    "a gradient assigned by hand); change gradients inside backward, or "
                    "use overlap='none'"
                )

    def finish(
        self, grads: Sequence[torch.Tensor | None], inputs: StepInputs, *, transactional: bool
    ) -> None:
        """Finish the step after the agreement: start the buckets no hook started, wait for
        all, then commit where kept (see :meth:`MuonPhase.close_early`)."""
        with self._side_stream():
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
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
