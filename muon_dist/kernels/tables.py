"""Small host-to-device copies through reused pinned buffers, and the address tables of
kernels that take many tensors in one launch.

A launch per tensor costs the host tens of microseconds in Triton's launcher, which a step
of many small pieces pays hundreds of times; a kernel that reads each tensor's address and
size from a table pays it once. Such a table, like Dion2's per-step indices, goes to the
device from pinned memory: pinning a fresh buffer per copy costs more than the copy, and a
copy from pageable memory would wait for the whole stream. A :class:`PinnedStaging` buffer
is rewritten only once the copy that last read it is done (an event).

A captured step (:class:`StepStaging`) keeps its tables in device memory, written once
after the capture: a replay copies none of them, nothing else rewrites them, and the capture
itself neither pins memory nor waits on a copy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import numpy as np
import torch

_SLOTS = 64  # address tables in flight per device, far more than a step has unread


class PinnedStaging:
    """One pinned host buffer, grown as needed, through which int64 vectors are copied
    to a device again and again."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def upload(self, values: np.ndarray | Sequence[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, its copy queued on the current
        stream (after waiting, rarely, for this buffer's previous copy to be done).

        While a graph is captured there is nothing to wait for and nothing may wait: the
        capture began after a device synchronize, so the earlier copies are done, and no
        copy is recorded, since the graph reads this buffer at every replay."""
        values = np.asarray(values, dtype=np.int64)
        capturing = torch.cuda.is_current_stream_capturing()
        if self._copied is not None and not capturing:
            self._copied.synchronize()
        if self._host is None or self._host.numel() < values.size:
            self._host = torch.empty(max(2 * values.size, 1), dtype=torch.long, pin_memory=True)
        host = self._host[: values.size]
        host.numpy()[:] = values
        moved = host.to(device, non_blocking=True)
        self._copied = None
        if not capturing:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            self._copied.record()
        return moved


class HostMirror:
    """A host buffer of one device tensor's values, written in place and copied over whole:
    pinned for a CUDA tensor (its copy queued on the current stream, or captured into a
    graph, which repeats it at every replay), the tensor itself on the CPU. ``array`` is
    the buffer as numpy sees it; :meth:`wait` before writing it, :meth:`mark` once the work
    that copies it is queued."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self._host = target
        self._copied: torch.cuda.Event | None = None
        if target.device.type == "cuda":
            self._host = torch.empty_like(target, device="cpu", pin_memory=True)
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        self.array = self._host.numpy()

    def wait(self) -> None:
        """Wait, rarely, until the work marked last has read the buffer (a step waits for
        the previous step's outcome before this anyway)."""
        if self._copied is not None:
            self._copied.synchronize()

    def send(self) -> None:
        """Queue the copy of the values written to the device tensor (nothing on the CPU)."""
        if self._copied is not None:
            self.target.copy_(self._host, non_blocking=True)

    def mark(self) -> None:
        """The work queued so far includes the last copy (or replay) reading the buffer."""
        if self._copied is not None:
            self._copied.record()


class _Ring:
    """Address tables' staging buffers, taken in turn."""

    def __init__(self) -> None:
        self._slots = [PinnedStaging() for _ in range(_SLOTS)]
        self._next = 0

    def upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % _SLOTS
        return slot.upload(values, device)


class StepStaging:
    """The address tables of one captured step, in the order of its uploads, kept in device
    memory so that a replay copies none of them.

    Each round (a warm-up step, then the capture) starts from the first table. A warm-up
    copies its k-th table into a device tensor kept here, through a pinned buffer kept
    too. The capture writes its own k-th table (of the same length: the step's structure
    is the warm-up's) into that buffer and hands out that device tensor, copying nothing
    while the graph is captured; :meth:`settle` copies the capture's tables in once the
    capture is over, before the first replay. Only the step's own rounds write them: the
    tables stay as captured for as long as the graph replays them.
    """

    def __init__(self) -> None:
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned, on the device)
        self._next = 0
        self._unsettled: list[int] = []

    def upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        index, self._next = self._next, self._next + 1
        if not torch.cuda.is_current_stream_capturing():
            host = torch.tensor(values, dtype=torch.long).pin_memory()
            table = host.to(device, non_blocking=True)
            self._tables[index : index + 1] = [(host, table)]
            return table
        if index >= len(self._tables) or self._tables[index][0].numel() != len(values):
            raise RuntimeError(
                f"muon_dist: the captured step's address table {index} ({len(values)} "
                "values) has no table of its length from the warm-up step; this is a bug"
            )
        host, table = self._tables[index]
        host.numpy()[:] = values  # the capture began after a device synchronize
        self._unsettled.append(index)
        return table

    def settle(self) -> None:
        """Copy the tables of the capture just ended to the device, and wait for them."""
        for index in self._unsettled:
            host, table = self._tables[index]
            table.copy_(host, non_blocking=True)
        self._unsettled.clear()
        torch.cuda.current_stream().synchronize()

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """This context's address tables are this step's, from the first."""
        self._next = 0
        self._unsettled.clear()
        token = _step_staging.set(self)
        try:
            yield
        finally:
            _step_staging.reset(token)


_rings: dict[torch.device, _Ring] = {}
_step_staging: contextvars.ContextVar[StepStaging | None] = contextvars.ContextVar(
    "step_staging", default=None
)


def tables_allowed(device: torch.device) -> bool:
    """Whether a kernel may read an address table made now: always outside a graph capture;
    inside one only in a captured step's round (:meth:`StepStaging.round`), whose buffers
    are never rewritten while the graph replays them. A table of another capture would go
    through the shared ring, rewritten long before its last replay."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return True
    return _step_staging.get() is not None


def address_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``rows`` (per tensor: addresses, then sizes) as one int64 tensor on ``device``,
    flat, in row order; its copy is queued on the current stream. Only where
    :func:`tables_allowed`."""
    flat = [value for row in rows for value in row]
    if device.type != "cuda":
        return torch.tensor(flat, dtype=torch.long)
    staging = _step_staging.get()
    if staging is not None:
        return staging.upload(flat, device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "muon_dist: an address table was made while a graph outside the optimizer's "
            "captured step was being captured; this is a bug (check tables_allowed first)"
        )
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = _Ring()
    return ring.upload(flat, device)
