"""Dion2's wing: the owner orthogonalizes each matrix's top slices only, the selected
buckets move only those (:class:`muon_dist.comm.dion2_exchange.SelectedExchange`, whose
choice is made here), and the write feeds the error back into the momentum of the slices
orthogonalized.

Every rank adds its source pieces' partial slice norms (float64) into the bucket's norm
vector and one all-reduce sums them; every rank then takes the same top slices
(:func:`muon_dist.rules.dion2_slices.top_slices`), so the choice is exact and independent of
the layout. The owner finds its stack's choice where the exchange left it
(:class:`ChosenSlices`); a bucket that does not move selected slices (a captured step's, or
one that does not communicate) chooses on the owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muon_dist.comm.dion2_exchange import DeviceSelection, SelectedExchange, wait_for
from muon_dist.comm.exchange import BucketExchange
from muon_dist.comm.groups import dedicated
from muon_dist.kernels.streams import side_stream
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import BucketMap, StackSpec
from muon_dist.plan.build import Plan
from muon_dist.plan.dion2_selection import BucketSelection, Rect, take
from muon_dist.rules.base import RulePart
from muon_dist.rules.dion2_slices import add_slice_norms_, selected_orthogonalize, top_slices
from muon_dist.step.bucket.orthogonalizer import OwnerPart
from muon_dist.step.shard.entries import local_box
from muon_dist.step.wings.base import Wing, WingSite


class ChosenSlices(OwnerPart):
    """Newton–Schulz on the chosen slices (the recipe ``part``'s fraction of them) of each
    matrix of stack ``stack``, stored as ``part`` says: those its selected exchange left in
    ``chosen``, else chosen here. Its stacks, a share of the slices, replay from graphs
    whatever their size: launching their Newton–Schulz costs the host more than the GPU's
    work."""

    graphed = True
    beside = False  # its stacks replay from graphs of their own (graphed)

    def __init__(
        self, part: RulePart, backend: str, chosen: dict[int, list[torch.Tensor]], stack: int
    ) -> None:
        self._fraction, self._transposed = float(part.fraction or 0.0), bool(part.transposed)
        self._backend, self._chosen, self._stack = backend, chosen, stack

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
    ) -> torch.Tensor:
        # A part is handed over by output rows, whatever the storage.
        transposed = self._transposed and part is None
        chosen = self._chosen.get(self._stack)
        index = None if chosen is None else chosen[part or 0]
        return selected_orthogonalize(
            x, orthogonalize, self._fraction, transposed, self._backend, index
        )


class SliceFeedback:
    """One piece's error feedback: its momentum view and its group, whose β is read at
    every write (a scheduler may change it between steps)."""

    def __init__(self, momentum: torch.Tensor, group: dict[str, Any]) -> None:
        self.momentum, self.group = momentum, group

    def args(self) -> tuple[torch.Tensor, float]:
        return self.momentum, self.group["momentum"]


class ErrorFeedback:
    """Dion2's write part: it makes each written piece's :class:`SliceFeedback`."""

    def of_piece(self, momentum: torch.Tensor, group: dict[str, Any]) -> SliceFeedback:
        return SliceFeedback(momentum, group)


_FEEDBACK = ErrorFeedback()


def selected_buckets(
    plan: Plan, views: frozenset[int], ranks: Sequence[int], settings: ExecutionSettings
) -> frozenset[int]:
    """The buckets that move only the selected slices: those that exchange and hold one of
    ``views`` owned among ``ranks``, unless the step is captured (a captured step's
    exchange sizes are fixed)."""
    return frozenset(
        index
        for index, bucket in enumerate(plan.buckets)
        if bucket.communicates
        and not settings.cuda_graph
        and any(b.view in views and b.owner in ranks for b in bucket.blocks)
    )


class Dion2Wing(Wing):
    """The selected buckets (:attr:`packed`) with their layouts (made on each one's first
    step) and the choice their exchanges ask for; the owner part and the write part."""

    def __init__(self, site: WingSite, views: frozenset[int]) -> None:
        super().__init__(site, views)
        self._selected = selected_buckets(
            site.plan, views, site.exchanges.peers.ranks, site.settings
        )
        self._layouts: dict[int, DeviceSelection] = {}
        self._maps: Sequence[BucketMap] = ()
        self.choice = SliceChoice(site, self._selected)

    @property
    def packed(self) -> frozenset[int]:
        return self._selected

    def lay_out(self, maps: Sequence[BucketMap]) -> None:
        self._maps = maps

    def _layout(self, index: int) -> DeviceSelection:
        """Bucket ``index``'s selection layout, laid out on its first step."""
        found = self._layouts.get(index)
        if found is None:
            site = self.site
            entries = site.entries
            selects = {
                i: (
                    float(entries[i].group["dion2_fraction"]),
                    entries[i].view.part_split(entries[i].group["adjust_lr"]),
                )
                for i in self.views
            }
            found = self._layouts[index] = DeviceSelection(
                BucketSelection(
                    site.plan.buckets[index],
                    site.plan.rank,
                    site.exchanges.peers.ranks,
                    [e.view for e in entries],
                    selects,
                    lambda view: local_box(entries[view], site.comm),
                    self._maps[index].stacks,
                ),
                site.exchanges.device,
            )
        return found

    def owner(self, spec: StackSpec) -> OwnerPart:
        part = spec.recipe.rule if spec.recipe is not None else None
        if part is None or part.fraction is None:
            return OwnerPart()
        return ChosenSlices(part, self.site.settings.backend, self.choice.chosen, spec.index)

    def write_part(self) -> ErrorFeedback:
        return _FEEDBACK

    def exchange(self, index: int, where: BucketMap) -> BucketExchange | None:
        if index not in self._selected:
            return None
        return SelectedExchange(where, self._layout(index), self.site.exchanges, self.choice)


class SliceChoice:
    """The choice of a selected exchange (:class:`muon_dist.comm.dion2_exchange.Choice`):
    the slice norms on their own communicator and stream, so that neither waits behind the
    all-to-alls and a bucket's host copy of its choice waits for nothing else; the chosen
    slices of each stack, per part, left in :attr:`chosen` for its owner part."""

    def __init__(self, site: WingSite, selected: frozenset[int]) -> None:
        peers, selects = site.exchanges.peers, bool(selected)
        self._norm_peers = dedicated(peers, "dion2 norms") if selects else peers
        self._backend = site.settings.backend
        self.stream: torch.cuda.Stream | None = None
        if selects and site.exchanges.device.type == "cuda":
            self.stream = side_stream(site.exchanges.device, "dion2 choice")
        self.chosen: dict[int, list[torch.Tensor]] = {}

    def choose(
        self,
        layout: DeviceSelection,
        inputs: Sequence[torch.Tensor],
        planes: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The bucket's chosen slices: partial norms of this rank's pieces, summed over the
        exchange peers, and the same top slices on every rank."""
        sel, device = layout.host, layout.device
        # On ``device``: a rank holding nothing of the bucket has neither inputs nor planes.
        norms = torch.zeros(sel.slots, dtype=torch.float64, device=device)
        sources = [*zip(inputs, layout.send_tiles, strict=True)]
        sources += [
            (planes[piece.stack], tiles)
            for piece, tiles in zip(sel.own, layout.own_tiles, strict=True)
        ]
        add_norms(norms, sources, self._backend)
        # The choice follows at once on this stream (which waits for the all-reduce, the host
        # does not): queued after the next buckets' staging, it would wait for them.
        wait_for(dist.all_reduce(norms, group=self._norm_peers.group, async_op=True))
        chosen = torch.empty(sel.chosen_count, dtype=torch.long, device=device)
        for slot, n, length, count, first in sel.batches:
            top = top_slices(norms[slot : slot + n * length].view(n, length), count)
            chosen[first : first + n * count].view(n, count).copy_(top)
        return chosen

    def keep(self, where: BucketMap, layout: DeviceSelection, chosen: torch.Tensor) -> None:
        for position, parts in layout.stack_chosen.items():
            self.chosen[where.stacks[position].index] = [chosen[index] for index in parts]


def add_norms(
    norms: torch.Tensor,
    sources: Sequence[tuple[torch.Tensor, Sequence[tuple[Rect, int, torch.Tensor]]]],
    backend: str,
) -> None:
    """Add the slice norms (L1, float64) of each source's tiles at their slots, in one
    pass over all of them."""
    xs, axes, slots = [], [], []
    for x, tiles in sources:
        for rect, axis, where in tiles:
            xs.append(take(x, rect).view(rect.shape))
            axes.append(-2 if axis == 0 else -1)
            slots.append(where)
    add_slice_norms_(norms, xs, axes, slots, backend)
