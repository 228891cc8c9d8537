"""Defects injected into the sharded step, to show that the bf16 parity comparison sees them.

Each defect patches one seam that outlives refactors of the step: the plan
(``plan.build.build_plan``, pure geometry), the lr scale (``plan.views.MatrixView.lr_scale``) or
the packed exchange buffers (``dist.exchange.pack``). A defect counts how often it struck, so a
test can tell a defect that was caught from one that never reached the step.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from parity_cases import PRECISIONS, cases_for, run_case

from muon_dist.comm import exchange
from muon_dist.plan import build as plan
from muon_dist.plan import packing
from muon_dist.plan import views as routing


@dataclasses.dataclass
class Hits:
    """How many times a defect changed the step."""

    count: int = 0


@contextmanager
def _rebound(original: Callable[..., Any], replacement: Callable[..., Any]) -> Iterator[None]:
    """Bind ``replacement`` wherever a loaded ``muon_dist`` module binds ``original``, so the
    defect reaches every caller however it imported the function."""
    bindings = [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.split(".")[0] == "muon_dist"
        for name, value in list(vars(module).items())
        if value is original
    ]
    for module, name in bindings:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name in bindings:
            setattr(module, name, original)


def _slices_shape(slices: plan.Slices) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in slices)


@contextmanager
def shard_offset() -> Iterator[Hits]:
    """An owner places its own piece and a received piece of one matrix at each other's
    offsets: the reassembled matrix has two shards swapped."""
    hits = Hits()
    original = plan.build_plan

    def build(*args: Any, **kwargs: Any) -> plan.Plan:
        built = original(*args, **kwargs)
        for bucket in built.buckets:
            for index, block in enumerate(bucket.owned):
                if block.own_slices is None or hits.count:
                    continue
                own_local, own_block = block.own_slices
                for j, piece in enumerate(bucket.gather_recvs):
                    if piece.block == index and piece.shape == _slices_shape(own_block):
                        bucket.owned[index] = dataclasses.replace(
                            block, own_slices=(own_local, piece.slices)
                        )
                        bucket.gather_recvs[j] = dataclasses.replace(piece, slices=own_block)
                        hits.count += 1
                        break
        return built

    with _rebound(original, build):
        yield hits


@contextmanager
def lr_scale_of_shard() -> Iterator[Hits]:
    """The lr scale read from the shape of a ``Shard(0)`` shard instead of the full matrix."""
    hits = Hits()
    original = routing.MatrixView.lr_scale

    def lr_scale(view: routing.MatrixView, adjust_lr: str | None) -> float:
        hits.count += 1
        rows = -(-view.rows // dist.get_world_size())
        return original(dataclasses.replace(view, rows=rows), adjust_lr)

    routing.MatrixView.lr_scale = lr_scale
    try:
        yield hits
    finally:
        routing.MatrixView.lr_scale = original


@contextmanager
def lr_scale_five_percent_high() -> Iterator[Hits]:
    """Every lr scale 5% too large: a small defect, near what bf16 rounding could hide."""
    hits = Hits()
    original = routing.MatrixView.lr_scale

    def lr_scale(view: routing.MatrixView, adjust_lr: str | None) -> float:
        hits.count += 1
        return 1.05 * original(view, adjust_lr)

    routing.MatrixView.lr_scale = lr_scale
    try:
        yield hits
    finally:
        routing.MatrixView.lr_scale = original


def _packed(edit: Callable[[torch.Tensor], bool]) -> Callable[[], Any]:
    """A defect applied by ``edit`` to the first piece of every packed exchange buffer that
    it changes (``edit`` returns whether it did)."""

    @contextmanager
    def defect() -> Iterator[Hits]:
        hits = Hits()
        original = exchange.pack

        def pack(
            layout: packing.Packing, fill: Callable[[list[torch.Tensor]], object], *rest: Any
        ) -> torch.Tensor:
            def edited_fill(views: list[torch.Tensor]) -> None:
                fill(views)
                if any(edit(view) for view in views):
                    hits.count += 1

            return original(layout, edited_fill, *rest)

        with _rebound(original, pack):
            yield hits

    return defect


def _transpose(view: torch.Tensor) -> bool:
    """Write the piece's transpose into its slot, as a sender holding ``[in, out]`` would."""
    if view.ndim < 2 or min(view.shape[-2:]) < 2:
        return False
    view.copy_(view.transpose(-2, -1).contiguous().view(view.shape))
    return True


def _drop(view: torch.Tensor) -> bool:
    """Send zeros in place of the piece."""
    if view.numel() == 0:
        return False
    view.zero_()
    return True


transposed_piece = _packed(_transpose)
dropped_piece = _packed(_drop)

DEFECTS: dict[str, Callable[[], Any]] = {
    "shard_offset": shard_offset,
    "lr_scale_of_shard": lr_scale_of_shard,
    "lr_scale_five_percent_high": lr_scale_five_percent_high,
    "transposed_piece": transposed_piece,
    "dropped_piece": dropped_piece,
}


def mutated_parity_worker(
    rank: int, world_size: int, name: str, precision: str, defect: str
) -> dict[str, Any]:
    """The parity case ``name`` with ``defect`` injected: its errors and the defect's hits."""
    (case,) = [c for c in cases_for(world_size) if c.name == name]
    comm_dtype, ns_dtype = PRECISIONS[precision]
    with DEFECTS[defect]() as hits:
        errors = run_case(case, getattr(torch, comm_dtype), getattr(torch, ns_dtype), world_size)
    return {"errors": errors, "hits": hits.count}
