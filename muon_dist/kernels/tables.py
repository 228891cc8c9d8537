"""Address tables for kernels that take many tensors in one launch.

A launch per tensor costs the host tens of microseconds in Triton's launcher, which a step
of many small pieces pays hundreds of times; a kernel that reads each tensor's address and
size from a table pays it once. The table goes to the device through a ring of pinned host
slots: pinning a fresh buffer per launch costs more than the launch saves, and a copy from
pageable memory would wait for the whole stream. A slot is rewritten only once the copy
that last read it is done (an event per slot; by then long past, the ring being much
longer than the copies in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SLOTS = 64
_SLOT_ELEMENTS = 2048  # int64 entries: 16 KiB, a table of ~290 tensors of 7 entries


class _Ring:
    def __init__(self) -> None:
        self._host = torch.empty(_SLOTS, _SLOT_ELEMENTS, dtype=torch.long, pin_memory=True)
        self._copied: list[torch.cuda.Event | None] = [None] * _SLOTS
        self._next = 0

    def upload(self, rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        flat = [value for row in rows for value in row]
        if len(flat) > _SLOT_ELEMENTS:  # an unusually long table: pinned on its own
            host = torch.tensor(flat, dtype=torch.long).pin_memory()
            return host.to(device, non_blocking=True)
        slot = self._next
        self._next = (slot + 1) % _SLOTS
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        host = self._host[slot, : len(flat)]
        host.numpy()[:] = flat
        table = host.to(device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        event.record()
        self._copied[slot] = event
        return table


_rings: dict[torch.device, _Ring] = {}


def address_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``rows`` (per tensor: addresses, then sizes) as one int64 tensor on ``device``,
    flat, in row order; its copy is queued on the current stream."""
    if device.type != "cuda":
        return torch.tensor([value for row in rows for value in row], dtype=torch.long)
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = _Ring()
    return ring.upload(rows, device)
