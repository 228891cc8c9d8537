"""Muon's optimizer state on this rank, and how a step advances it: the momenta (views of
one flat buffer per group, :mod:`muon_dist.state.flat`) and the Magma scores (one per matrix).

The formulas are :mod:`muon_dist.rules.ops`'s; this module decides how the tensors are
batched: momenta of tensors kept exactly when the step is share one select per span of
their buffer, Magma's sums share one all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.comm.groups import Peers
from muon_dist.rules.ops import (
    advance_momenta,
    magma_damping,
    magma_score_,
    magma_sums,
    store_momentum_,
)
from muon_dist.state.flat import Span, spans

# Runs of momenta lying in order in one buffer: (span, tensor indices, 1-D momentum views).
MomentumSpans = list[tuple[Span, list[int], list[torch.Tensor]]]


class MuonState:
    """Momenta and Magma scores of the Muon tensors (indexed as the step's tensors)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        groups: Sequence[dict[str, Any]],
        row_matrices: dict[int, torch.Tensor],
        holders: Peers,
    ) -> None:
        self.params = list(params)
        self.groups = list(groups)
        self.magma = sorted(row_matrices)  # tensors under Magma
        # Per Magma tensor, for each dim-0 row of the local shard, which matrix it is in.
        self.row_matrices = row_matrices
        self.holders = holders  # Magma's sums run among them
        self.momenta: list[torch.Tensor] = []
        self.scores: dict[int, torch.Tensor] = {}
        self._spans: dict[tuple[int, ...], MomentumSpans] = {}
        self._flat_grads: list[torch.Tensor | None] = [None] * len(self.params)

    def bind(
        self, state: dict[torch.Tensor, dict[str, Any]], local_momenta: list[torch.Tensor]
    ) -> None:
        """Point at the momentum buffers and Magma scores (again after a state load)."""
        self.momenta = local_momenta
        self.scores = {j: state[self.params[j]]["magma_score"] for j in self.magma}
        self._spans = {}

    def forget_grads(self, changed: Sequence[int]) -> None:
        """These tensors' gradients changed: their flat views are taken again."""
        flats = self._flat_grads
        for j in changed:
            flats[j] = None

    def advance_momenta(
        self,
        by_beta: dict[float, list[int]],
        grads: Sequence[torch.Tensor],
        local_grad: tuple[bool, ...],
        ok: torch.Tensor,
        keep_of: Sequence[torch.Tensor],
    ) -> None:
        """Advance and store the momenta of ``by_beta``'s tensors (one foreach pass per
        coefficient).

        A tensor with a local gradient is kept exactly when the step is (``ok``): those
        share one flag and, lying in order in their group's buffer, one select per span.
        The others carry their own flag, which depends on the other ranks' gradients.
        """
        everywhere = all(local_grad)
        for beta, members in by_beta.items():
            shared = tuple(members if everywhere else (j for j in members if local_grad[j]))
            for span, chosen, flat_momenta in self._momentum_spans(shared):
                flat_grads = None if span.flat is None else self._flat_grads_of(chosen, grads)
                if flat_grads is not None:
                    store_momenta_(flat_grads, flat_momenta, beta, ok, span)
                else:
                    momenta = [self.momenta[j] for j in chosen]
                    store_momenta_([grads[j] for j in chosen], momenta, beta, ok)
            if everywhere:
                continue
            for j in members:
                if not local_grad[j]:
                    store_momenta_([grads[j]], [self.momenta[j]], beta, keep_of[j])

    def _momentum_spans(self, members: tuple[int, ...]) -> MomentumSpans:
        """Runs of ``members`` whose momenta lie in order in one buffer, with each run's
        tensors and one-dimensional momentum views; found once per set of members."""
        found = self._spans.get(members)
        if found is None:
            found = self._spans[members] = [
                (span, chosen, [self.momenta[j].view(-1) for j in chosen])
                for span in spans([self.momenta[j] for j in members])
                for chosen in ([members[i] for i in span.members],)
            ]
        return found

    def _flat_grads_of(
        self, chosen: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """The local gradients of ``chosen`` as one dimension, or None where one cannot
        share its momentum's span; a view is taken once per gradient tensor."""
        flats = self._flat_grads
        for j in chosen:
            if flats[j] is None:
                grad = grads[j]
                if not grad.is_contiguous():
                    return None
                flats[j] = grad.view(-1)
        return [flats[j] for j in chosen]  # type: ignore[misc]

    def advance_magma(
        self, grads: Sequence[torch.Tensor], keep_of: Sequence[torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Advance the Magma scores; returns each Magma tensor's damping per local row.

        Each rank sums dot products and squared norms of its rows per matrix; one all-reduce
        completes them, so every rank sees the cosine of the whole matrix. Replicas add a
        piece once per copy, which the cosine's ratio cancels.
        """
        sums = []
        device = self.momenta[self.magma[0]].device
        for j in self.magma:
            per_row = magma_sums(self.momenta[j], grads[j])
            total = torch.zeros(3, self.scores[j].numel(), device=device)
            sums.append(total.index_add_(1, self.row_matrices[j], per_row))
        totals = torch.cat(sums, dim=1)
        if self.holders.size > 1:
            dist.all_reduce(totals, group=self.holders.group)
        damping: dict[int, torch.Tensor] = {}
        offset = 0
        for j in self.magma:
            score = self.scores[j]
            dot, mm, gg = totals[:, offset : offset + score.numel()]
            offset += score.numel()
            magma_score_(score, dot, mm, gg, beta=self.groups[j]["magma_beta"], keep=keep_of[j])
            damping[j] = magma_damping(score)[self.row_matrices[j]]
        return damping


def store_momenta_(
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    beta: float,
    keep: torch.Tensor,
    span: Span | None = None,
) -> None:
    """Advance every momentum where ``keep`` (one flag for all of them).

    With ``span``, the momenta lie in order in one buffer (:func:`muon_dist.state.flat.spans`)
    and both lists hold one-dimensional views: the advanced values are written into one
    scratch buffer laid out like the span, and one ``where`` over the whole span stores
    them, instead of one per momentum. Where the gradients are wider than the momenta
    (``momentum_dtype="bf16"``), the scratch is in the gradients' dtype, the span is read
    widened and the scratch rounded back in one pass each, so the launches stay a few per
    span; gradients of several dtypes take the per-tensor form, each advanced in the wider
    of its own and its momentum's dtype. Both forms store what
    :func:`muon_dist.rules.ops.advance_momenta` computes.
    """
    kinds = {g.dtype for g in grads}
    if span is None or span.flat is None or len(kinds) > 1:
        for momentum, new in zip(momenta, advance_momenta(grads, momenta, beta), strict=True):
            store_momentum_(momentum, new, keep)
        return
    stored = span.flat.dtype
    (kind,) = kinds
    wide = stored if kind == stored else torch.promote_types(kind, stored)
    scratch = torch.empty_like(span.flat, dtype=wide)
    advanced = span.split(scratch)
    torch._foreach_copy_(advanced, list(grads))
    old = list(momenta) if wide == stored else span.split(span.flat.to(wide))
    torch._foreach_add_(advanced, old, alpha=beta)
    store_momentum_(span.flat, scratch if wide == stored else scratch.to(stored), keep)
