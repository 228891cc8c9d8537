"""A transactional step's writes (``nonfinite="skip_step"``, or a step begun in backward),
held until every rank knows each Newton–Schulz result is finite."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from muon_dist.plan.bucket_map import LocalSlices


@dataclass(frozen=True)
class Held:
    """A transaction's held pieces and updates as one write, and a key naming them across
    steps (the tuples they came in, in order)."""

    pieces: tuple[LocalSlices, ...]
    updates: list[torch.Tensor]
    key: Hashable


class SkipTransaction:
    """A transactional step's writes, held until every rank knows each result is finite."""

    def __init__(self) -> None:
        self._held: list[tuple[Sequence[LocalSlices], Sequence[torch.Tensor]]] = []

    def begin(self) -> None:
        """Hold nothing yet (what a dropped step left is let go)."""
        self._held = []

    def hold(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        self._held.append((pieces, updates))

    def held_bytes(self) -> int:
        """Bytes of the storages the held updates keep alive."""
        storages = {
            update.untyped_storage().data_ptr(): update.untyped_storage().nbytes()
            for _, updates in self._held
            for update in updates
        }
        return sum(storages.values())

    def end(self) -> Held:
        """What was held, let go here."""
        held, self._held = self._held, []
        return Held(
            tuple(piece for pieces, _ in held for piece in pieces),
            [update for _, updates in held for update in updates],
            tuple(id(pieces) for pieces, _ in held),
        )
