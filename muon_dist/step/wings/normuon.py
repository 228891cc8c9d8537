"""NorMuon's wing: each output row of the owner's Newton–Schulz result normalized by its
running second moment, the moments every holder keeps (:mod:`muon_dist.state.normuon_moments`,
:mod:`muon_dist.rules.normuon_rows`) and their all-reduce after the buckets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from muon_dist.plan.bucket_map import BucketMap, StackSpec
from muon_dist.rules.normuon import ROW_MOMENT
from muon_dist.state.normuon_moments import RowMoments, StackRows, row_moments
from muon_dist.step.bucket.orthogonalizer import OwnerPart
from muon_dist.step.shard.entries import primary_owner
from muon_dist.step.wings.base import Wing


class RowNormalization(OwnerPart):
    """Newton–Schulz, then the rows normalized, for one stack whose rows are ``rows``."""

    beside = False  # every stack adds its rows' sums into one tensor of the wing

    def __init__(self, moments: RowMoments, rows: StackRows) -> None:
        self._moments, self._rows = moments, rows

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
    ) -> torch.Tensor:
        return self._moments.normalize(orthogonalize(x), self._rows, part)


class NorMuonWing(Wing):
    """The row moments of the rule's tensors (laid out with the bucket maps), the owner's
    row normalization, and one all-reduce of the rows' sums among the holders."""

    moments: RowMoments

    def lay_out(self, maps: Sequence[BucketMap]) -> None:
        site = self.site
        entries, settings = site.entries, site.settings
        tensors = site.tensors(self.views)
        self.moments = row_moments(
            [e.view for e in entries],
            [primary_owner(e, site.comm, settings.replica_mode) for e in entries],
            site.views_of,
            [site.group(j) for j in range(len(site.views_of))],
            tensors,
            [(b, m.stacks) for b, m in zip(site.plan.buckets, maps, strict=True)],
            site.comm.holders,
            site.device,
            settings.backend,
        )

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        self.moments.bind({j: state[self.site.param(j)][ROW_MOMENT] for j in self.moments.spans})

    def owner(self, spec: StackSpec) -> OwnerPart:
        rows = self.moments.stacks.get(spec.index)
        return OwnerPart() if rows is None else RowNormalization(self.moments, rows)

    def start(self) -> None:
        self.moments.start()

    def finish(self, keep_of: Sequence[torch.Tensor]) -> None:
        self.moments.finish(keep_of)
