"""Bytes one rank sends in an optimizer step, counted at torch.distributed's collectives.

muon_dist moves data only through ``dist.all_to_all_single`` (the buckets' gathers and
scatters) and ``dist.all_reduce`` (the step's agreement and per-rule vectors); both are looked
up on the module at call time, so counting them here sees every byte whatever the update rule.
What is counted is what this rank puts on the wire for other ranks: an all-to-all's input
without the part addressed to itself, and for an all-reduce the ``2·(W − 1)/W`` of the tensor
that a ring all-reduce sends per rank. Collectives of other libraries (DTensor's functional
collectives, which the all-gather baseline uses) are not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class SentBytes:
    """Bytes this rank sent, by collective."""

    all_to_all: int = 0
    all_reduce: int = 0

    @property
    def total(self) -> int:
        return self.all_to_all + self.all_reduce


def _to_others(
    tensor: torch.Tensor, splits: list[int] | None, group: dist.ProcessGroup | None
) -> int:
    """Bytes of an all-to-all's input addressed to ranks other than this one."""
    size = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    rows = tensor.shape[0] if tensor.ndim else 0
    per_row = tensor.numel() // rows if rows else 0
    sizes = list(splits) if splits else [rows // size] * size
    return (rows - sizes[me]) * per_row * tensor.element_size()


@contextmanager
def counting() -> Iterator[SentBytes]:
    """Count the bytes this rank sends through muon_dist's collectives inside the block."""
    sent = SentBytes()
    all_to_all: Callable[..., Any] = dist.all_to_all_single
    all_reduce: Callable[..., Any] = dist.all_reduce

    def counted_all_to_all(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        sent.all_to_all += _to_others(input, input_split_sizes, group)
        return all_to_all(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        size = dist.get_world_size(kwargs.get("group"))
        sent.all_reduce += 2 * (size - 1) * tensor.numel() * tensor.element_size() // size
        return all_reduce(tensor, *args, **kwargs)

    dist.all_to_all_single = counted_all_to_all  # type: ignore[assignment]
    dist.all_reduce = counted_all_reduce  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.all_to_all_single = all_to_all  # type: ignore[assignment]
        dist.all_reduce = all_reduce  # type: ignore[assignment]
