"""NorMuon's per-row second moments on this rank, and the one all-reduce that keeps every
holder's copy equal.

Each NorMuon parameter keeps one fp32 vector (``state[p][ROW_MOMENT]``), replicated on every
rank that holds a piece of it: the second moment of each output row of each of its
matrices, matrix after matrix in the order of its views. The owner of a matrix sees the
whole orthogonalized update, so it computes the rows' sums of squares and advances their
moments for its own normalization (:func:`muon_dist.rules.normuon_rows.row_factors`). One owner
per matrix, its primary one, writes the sums into this step's vector over all NorMuon rows,
zero elsewhere: under ``replica_mode="redundant"`` each replica has an owner, and only the
first replica's (coordinate 0 on the replicated mesh dims) counts. After the buckets, one
all-reduce among the holders gives every rank every row's sums, each added only to zeros
and so bitwise the primary owner's; every rank then advances its copies by the same
formula, where the step keeps the tensor.
The state is thus exact and independent of the sharding, and a checkpoint of it resumes on
any world size.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.comm.groups import Peers
from muon_dist.plan.bucket_map import StackSpec
from muon_dist.plan.build import BucketPlan
from muon_dist.plan.views import MatrixView
from muon_dist.rules.normuon_rows import (
    owner_row_factors,
    row_squares,
    scale_rows_,
    second_moment_next,
)


@dataclass(frozen=True)
class StackRows:
    """Where the output rows of a stack's matrices lie in the vector of all NorMuon rows.

    ``index`` is ``[k, m]``; ``transposed`` stacks hold them as columns; ``parts`` gives,
    for a view whose matrices are cut into parts on the owner, each part's ``index`` (its
    own rows, normalized as a matrix of their own, ``[k, part rows]``); ``primary``
    (``[k, 1]``, None where all are) marks the matrices whose sums this rank reports."""

    index: torch.Tensor
    transposed: bool
    parts: tuple[torch.Tensor, ...] | None
    primary: torch.Tensor | None


def part_rows(sizes: Sequence[int], groups: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each part's positions among a matrix's output rows, in the order
    :meth:`muon_dist.plan.views.PartSplit.orthogonalize` hands the part's rows over."""
    period = sum(sizes)
    positions: list[torch.Tensor] = []
    offset = 0
    for size in sizes:
        within = torch.arange(offset, offset + size)
        starts = torch.arange(groups) * period
        positions.append((starts[:, None] + within[None, :]).reshape(-1).to(device))
        offset += size
    return tuple(positions)


class RowMoments:
    """The NorMuon rows of one plan: their layout, per-row coefficients and this step's
    sums of squares."""

    def __init__(
        self,
        spans: dict[int, tuple[int, int]],
        groups: dict[int, dict[str, Any]],
        in_dims: list[float],
        stacks: dict[int, StackRows],
        peers: Peers,
        device: torch.device,
        backend: str,
    ) -> None:
        self.spans = spans  # NorMuon tensor -> its rows [start, stop) in the vector
        self._groups = groups  # NorMuon tensor -> its group, whose β₂ and ε each step reads
        self._in_dims = torch.tensor(in_dims, dtype=torch.float32, device=device)
        self._beta2 = torch.zeros_like(self._in_dims)
        self._weight = torch.zeros_like(self._in_dims)  # (1 − β₂) / n
        self._eps = torch.zeros_like(self._in_dims)
        self._read: dict[int, tuple[float, float]] = {}
        self.stacks = stacks
        self._peers = peers
        self._backend = backend  # the optimizer's: whether the row scaling may be fused
        self._moments: dict[int, torch.Tensor] = {}
        self._current = torch.zeros(0, device=device)
        self._sums = torch.zeros(0, device=device)

    def bind(self, moments: dict[int, torch.Tensor]) -> None:
        """Point at the state vectors (again after a state load)."""
        self._moments = moments

    def _read_coefficients(self) -> None:
        """Each row's β₂, weight and ε from its group, rewritten in place (so a captured
        step reads them) only where a group's values changed, e.g. by a scheduler."""
        for j, group in self._groups.items():
            values = (float(group["normuon_beta2"]), float(group["normuon_eps"]))
            if self._read.get(j) == values:
                continue
            start, stop = self.spans[j]
            self._beta2[start:stop].fill_(values[0])
            torch.div(1.0 - values[0], self._in_dims[start:stop], out=self._weight[start:stop])
            self._eps[start:stop].fill_(values[1])
            self._read[j] = values

    def start(self) -> None:
        """This step's moments, side by side, and a zeroed vector for the owners' sums."""
        self._read_coefficients()
        if self.spans:
            self._current = torch.cat([self._moments[j] for j in self.spans])
            self._sums = torch.zeros_like(self._current)

    def normalize(self, result: torch.Tensor, rows: StackRows, part: int | None) -> torch.Tensor:
        """NorMuon's row normalization of an orthogonalized ``[k, ·, ·]`` stack (or of one
        part of its matrices, already ``[k, rows, cols]`` by output rows), in place in its
        dtype; records the rows' sums of squares for :meth:`finish`."""
        index = rows.index
        columns = False
        if part is not None and rows.parts is not None:
            index = rows.parts[part]
        elif rows.transposed:
            columns = True
        squares = row_squares(result.mT if columns else result)
        factors = owner_row_factors(
            squares,
            index,
            (self._current, self._beta2, self._weight, self._eps),
            rows.primary,
            self._sums,
            self._backend,
        )
        scale_rows_(result, factors, columns=columns, backend=self._backend)
        return result

    def finish(self, keep_of: Sequence[torch.Tensor]) -> None:
        """Complete the sums among the holders and advance every copy where kept."""
        if not self.spans:
            return
        if self._peers.size > 1:
            dist.all_reduce(self._sums, group=self._peers.group)
        advanced = second_moment_next(self._current, self._sums, self._beta2, self._weight)
        for j, (start, stop) in self.spans.items():
            moment = self._moments[j]
            torch.where(keep_of[j], advanced[start:stop], moment, out=moment)


def row_moments(
    views: Sequence[MatrixView],
    primary: Sequence[bool],
    views_of: Sequence[Sequence[int]],
    groups: Sequence[dict[str, Any]],
    normalized: Collection[int],
    stacks: Sequence[tuple[BucketPlan, Sequence[StackSpec]]],
    peers: Peers,
    device: torch.device,
    backend: str,
) -> RowMoments:
    """Lay out the rows of the ``normalized`` tensors (NorMuon's, by position) and
    index every stack of their matrices. ``views`` are the plan's views, ``primary`` whether
    this rank is the primary owner of each view's matrices it owns, ``views_of`` each
    tensor's views, ``stacks`` each bucket's plan and stacks, ``peers`` the holders, ``backend`` the
    optimizer's kernel backend."""
    spans: dict[int, tuple[int, int]] = {}
    base_of_view: dict[int, int] = {}
    in_dims: list[float] = []
    total = 0
    for j in range(len(groups)):
        if j not in normalized:
            continue
        start = total
        for i in views_of[j]:
            out_dim, in_dim = views[i].out_in
            count = views[i].count * out_dim
            base_of_view[i] = total
            in_dims += [float(in_dim)] * count
            total += count
        spans[j] = (start, total)
    indexed: dict[int, StackRows] = {}
    for bucket, specs in stacks:
        for spec in specs:
            if spec.views[0] not in base_of_view:
                continue
            view = views[spec.views[0]]
            out_dim = view.out_in[0]
            blocks = [bucket.owned[b] for b in spec.blocks]
            rows = [
                torch.arange(base + matrix * out_dim, base + (matrix + 1) * out_dim)
                for block in blocks
                for base in (base_of_view[block.view],)
                for matrix in range(block.start, block.stop)
            ]
            flags = [
                primary[block.view] for block in blocks for _ in range(block.start, block.stop)
            ]
            index = torch.stack(rows).to(device)
            indexed[spec.index] = StackRows(
                index,
                view.transposed,
                None
                if view.parts is None
                else tuple(index[:, part] for part in part_rows(*view.parts, device)),
                None if all(flags) else torch.tensor(flags, device=device).view(-1, 1),
            )
    normuon_groups = {j: groups[j] for j in spans}
    return RowMoments(spans, normuon_groups, in_dims, indexed, peers, device, backend)
