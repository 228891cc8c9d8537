"""Capture of the whole optimizer step in one CUDA graph, and its replay.

A step of many small matrices is bound by the host: each kernel launch and collective
costs microseconds of Python and driver work. Replaying a captured graph launches the
same work with one call. What a replay cannot see, it must not depend on:

- the learning rates are staged into device memory before each replay, so schedulers
  keep working; any other change to a group (momentum, weight decay, betas, ...) makes
  the next step eager warm-up and capture again;
- the gradients: the graph reads the gradient tensors it was captured with, and keeps
  them. A replay first copies every gradient that is not one of those tensors into it
  (one ``torch._foreach_copy_``), so ``zero_grad()`` in either form works and the result
  is the eager step's; gradients kept in place (``set_to_none=False``) are read as they
  are, with no copy. Which parameters have a gradient is part of what was captured: a
  change captures again;
- ``load_state_dict`` replaces state tensors, so it drops the graph too.

Warm-up steps run eagerly on the capture stream first, so that Triton autotuning, cuBLAS
workspaces and NCCL communicators exist before capture. A graph holding collectives keeps
them alive: drop the optimizer before ``dist.destroy_process_group()``.

Under ``cuda_graph="auto"`` (:func:`capture_blocker` decides at construction whether the
job allows capture) a :class:`StepGraph` given ``fallback`` runs eagerly from then on,
saying why once, where capture fails or keeps being redone (a scheduler that changes
momentum every step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from muon_dist.comm.groups import CommGroups
from muon_dist.kernels.graphs import capturing
from muon_dist.kernels.streams import side_stream
from muon_dist.kernels.tables import StepStaging
from muon_dist.options.settings import ExecutionSettings
from muon_dist.state.tensors import data_ptr

logger = logging.getLogger(__name__)

# Under "auto": option changes (each a new warm-up and capture) after which steps run
# eagerly instead; a scheduler that cycles momentum changes it every step.
RECAPTURE_LIMIT = 3


def capture_blocker(
    settings: ExecutionSettings, device: torch.device, comm: CommGroups
) -> str | None:
    """Why this job's step cannot be captured, or None where it can: parameters off CUDA,
    a step that starts during backward, collectives on a backend without CUDA-graph
    support."""
    if device.type != "cuda":
        return f"the parameters are on {device}, and CUDA graphs capture CUDA work only"
    if settings.starts_in_backward:
        return (
            f"overlap={settings.overlap!r} starts Newton-Schulz from gradient hooks during "
            "backward, outside any captured step"
        )
    if comm.world_size > 1:
        for peers in (comm.holders, comm.exchange):
            try:
                backend = str(dist.get_backend(peers.group))
            except (RuntimeError, ValueError):
                continue
            if "nccl" not in backend:
                return (
                    f"the step's collectives run on the {backend!r} backend, which CUDA "
                    "graphs cannot capture (NCCL can)"
                )
    return None


class StepGraph:
    """Warm up ``warmup`` eager steps, capture the next one, then replay it.

    ``fallback`` (None: capture is forced, ``cuda_graph=True``): under
    ``cuda_graph="auto"``, called once with the reason where capture fails or is redone
    more than :data:`RECAPTURE_LIMIT` times; every later step then runs eagerly. ``note``:
    told why a single step runs eagerly (:meth:`uncaptured`).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.fallback: Callable[[str], None] | None = None
        self.note: Callable[[str], None] | None = None
        # Under "auto": whether every rank captured (a rank alone on eager steps would
        # run its collectives against the others' replays); None: this rank decides alone.
        self.agree: Callable[[bool], bool] | None = None
        self.given_up: str | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None
        self._key: Hashable = None
        self._held: tuple[torch.Tensor, ...] = ()
        self._staging = StepStaging()  # the address tables the graph reads
        self._pointers: tuple[int, ...] = ()  # the gradients' addresses at capture
        self._now: tuple[int, ...] = ()  # their addresses at the last step
        self._eager = 0
        self._changes = 0

    def reset(self) -> None:
        """Forget the graph (and the gradient tensors it reads): the next steps warm up and
        capture again."""
        if self._graph is not None:
            # A replay may still read the address tables: let it finish before they are
            # freed (new ones serve the next warm-up and capture).
            torch.cuda.synchronize()
            self._staging = StepStaging()
        self._graph = None
        self._held, self._pointers = (), ()
        self._eager = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def uncaptured(self, body: Callable[[], None], missing: Sequence[str]) -> None:
        """Run one step whose ``missing`` parameters have no gradient eagerly, as an
        uncaptured step treats them (the graph reads every gradient tensor); the graph
        stays for the next steps with every gradient."""
        if self.note is not None:
            self.note(
                f"a step where {len(missing)} parameters have no gradient (the first: "
                f"{missing[0]}) runs uncaptured, as later steps with a missing gradient do"
            )
        body()

    def run(
        self,
        body: Callable[[], None],
        key: Hashable,
        grads: Sequence[torch.Tensor],
        fresh: bool = True,
    ) -> None:
        """Run one step: eagerly while warming up, else by replaying the captured graph.

        ``grads`` are the local gradients ``body`` reads, one per parameter; ``fresh``:
        whether any is another tensor than at the last step (else their addresses are the
        last step's).
        """
        if self.given_up is not None:
            body()
            return
        if fresh or self._graph is None:
            self._now = tuple(map(data_ptr, grads))
        pointers = self._now
        if key != self._key:
            if self._key is not None:
                self._changes += 1
            self.reset()
            self._key = key
            if self.fallback is not None and self._changes > RECAPTURE_LIMIT:
                self._give_up(
                    f"the step's options changed {self._changes} times (each a new "
                    "warm-up and capture; e.g. a scheduler that changes momentum or weight "
                    "decay), so steps run eagerly"
                )
                body()
                return
        if self._graph is None and self._eager < self.warmup:
            self._warm_up(body)
            return
        if self._graph is None:
            self._capture(body, grads, pointers)
            if self._graph is None:  # capture failed under "auto": this step runs eagerly
                body()
                return
        elif pointers != self._pointers:
            self._copy_in(grads, pointers)
        self._graph.replay()

    def _warm_up(self, body: Callable[[], None]) -> None:
        if self._stream is None:
            self._stream = side_stream(torch.device("cuda"), "step warm-up")
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), self._staging.round():
            body()
        torch.cuda.current_stream().wait_stream(self._stream)
        self._eager += 1

    def _capture(
        self, body: Callable[[], None], grads: Sequence[torch.Tensor], pointers: tuple[int, ...]
    ) -> None:
        """Capture ``body`` reading ``grads``, which the graph keeps (no copy this step)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self._stream), self._staging.round():
                body()
        except Exception as exc:
            if self.fallback is None:
                raise
            failure: str | None = f"capturing the step failed ({type(exc).__name__}: {exc})"
        else:
            failure = None
        if self.agree is not None and not self.agree(failure is None) and failure is None:
            failure = "capturing the step failed on another rank"
        if failure is not None:
            self._give_up(failure)
            return
        self._staging.settle()
        self._graph, self._held, self._pointers = graph, tuple(grads), pointers

    def _copy_in(self, grads: Sequence[torch.Tensor], pointers: tuple[int, ...]) -> None:
        """Copy this step's gradients into the tensors the graph reads, where they differ
        (``zero_grad()`` freed them, or new tensors were assigned)."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for held, grad, now, then in zip(self._held, grads, pointers, self._pointers, strict=True):
            if now != then:
                targets.append(held)
                sources.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)

    def _give_up(self, reason: str) -> None:
        self.reset()
        self.given_up = reason
        if self.fallback is not None:
            self.fallback(reason)


class CaptureChoice:
    """The optimizer's ``cuda_graph`` setting applied to its job: ``settings`` with
    ``cuda_graph`` True or False, for building the step.

    ``"auto"`` captures where :func:`capture_blocker` finds nothing against it, and
    otherwise runs eagerly, saying why once in an INFO line (on rank 0; the same on every
    rank: it reads the device type, the options and the backend) and in
    ``uncaptured_reason``; a graph that gives up later says so the same way (:meth:`bind`).
    ``True`` refuses parameters off CUDA here; ``False`` never captures.
    """

    def __init__(self, settings: ExecutionSettings, device: torch.device, comm: CommGroups):
        requested = settings.cuda_graph
        if requested is True and device.type != "cuda":
            raise ValueError(
                f"cuda_graph=True captures CUDA work, and these parameters are on {device}; "
                "leave cuda_graph='auto' or False there (that path runs eagerly)"
            )
        self.requested = requested
        self.rank = comm.rank
        self._holders = comm.holders if comm.world_size > 1 else None
        self.uncaptured_reason: str | None = None
        self._noted: set[str] = set()
        capture = requested is True
        if requested == "auto":
            self.uncaptured_reason = capture_blocker(settings, device, comm)
            capture = self.uncaptured_reason is None
            if self.uncaptured_reason is not None:
                self.note(f"{self.uncaptured_reason}; steps run eagerly")
        self.settings = dataclasses.replace(settings, cuda_graph=capture)

    def bind(self, graph: StepGraph | None) -> None:
        """A newly built step's graph: it says why a step runs uncaptured, and under
        ``"auto"`` it falls back to eager steps rather than raise or capture again and
        again."""
        if graph is None:
            return
        graph.note = self.note
        if self.requested == "auto":
            graph.fallback = self._gave_up
            graph.agree = self._all_captured

    def _all_captured(self, captured: bool) -> bool:
        """Whether every rank holding parameters captured its step (one all-reduce, once
        per capture, outside it)."""
        if self._holders is None:
            return captured
        flag = torch.tensor([int(captured)], device=torch.device("cuda"))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._holders.group)
        return bool(flag.item())

    def _gave_up(self, reason: str) -> None:
        self.uncaptured_reason = reason
        self.note(reason)

    def note(self, reason: str) -> None:
        """Log why steps run uncaptured, once per reason, on rank 0."""
        if reason not in self._noted and self.rank == 0:
            logger.info("muon_dist.Muon: cuda_graph=%r: %s", self.requested, reason)
        self._noted.add(reason)
