"""What the bucket tasks of a step work with, handed to them as objects: how the exchanges
run, where the Newton–Schulz inputs come from and the updates go, and where a failure of
this rank's own work is flagged so that every rank learns of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muon_dist.comm.exchange import Exchanges
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import LocalSlices
from muon_dist.step.agree.failures import Failures
from muon_dist.step.bucket.orthogonalizer import Orthogonalizer
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.piece_io import PieceIO
from muon_dist.step.shard.transaction import SkipTransaction


@dataclass(frozen=True)
class BucketIO:
    """The reads of Newton–Schulz inputs and the writes of updates of every bucket task of
    a step of ``mode``: held by the transaction where the mode holds them, cast to the
    exchanges' dtype, and a failure recorded instead of raised (``step()`` raises it once
    every rank knows). A step begun from gradient hooks (:mod:`muon_dist.step.launch.backward`)
    holds copies of its updates, which must not pin their stacks until ``step()``."""

    io: PieceIO
    transaction: SkipTransaction
    failures: Failures
    settings: ExecutionSettings
    mode: StepMode

    def read(self, pieces: Sequence[LocalSlices], outs: Sequence[torch.Tensor]) -> None:
        """Write the Newton–Schulz input of each piece of a local shard into its ``out``,
        cast to its dtype (all pieces of one phase at once). ``pieces`` is one of a bucket
        map's tuples, the same object every step."""
        try:
            self.io.read(pieces, outs, self.mode)
        except Exception as exc:  # raised by step() once the other ranks know
            # Zero inputs orthogonalize to zero: the stack stays finite, the write a no-op.
            torch._foreach_zero_(list(outs))
            self.failures.of_pieces(exc, pieces)

    def write(self, pieces: Sequence[LocalSlices], updates: Sequence[torch.Tensor]) -> None:
        """Add each piece's scaled update to that piece of a local shard (all pieces of one
        phase at once, so they share launches); ``pieces`` as for :meth:`read`."""
        try:
            comm_dtype = self.settings.comm_dtype
            if self.settings.ns_dtype != comm_dtype:
                # Owners add their own result in the dtype the other holders receive it in,
                # so replicas of a parameter round identically and stay bitwise equal. Piece
                # by piece: a cast of whole stacks would hold both dtypes' stacks at once.
                updates = [update.to(comm_dtype) for update in updates]
            elif self.mode.early:
                # Held from backward to step(): copies of this rank's pieces only, so the
                # bucket's whole stacks and exchange buffers are freed meanwhile.
                updates = [update.clone() for update in updates]
            if self.mode.holds:
                self.transaction.hold(pieces, updates)
                return
            self.io.write(pieces, updates)
        except Exception as exc:  # raised by step() once the other ranks know
            self.failures.of_pieces(exc, pieces)


@dataclass(frozen=True)
class BucketTools:
    """What every bucket task of a phase works with: how the exchanges run, where inputs
    are read and updates written, and the owner's Newton–Schulz."""

    exchanges: Exchanges
    io: BucketIO
    orthogonalize: Orthogonalizer
