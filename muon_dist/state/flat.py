"""Per-parameter state as views of one flat buffer, so a pass over many of them is one launch.

Muon keeps its momentum buffers consecutive in memory (one buffer per dtype and device for
each parameter group; the dtype is the parameter's, or the group's ``momentum_dtype``):
the step can then select, in a single ``torch.where`` over the whole span, between the
advanced and the old momentum of every matrix, where per-tensor selects would cost a
launch per matrix. Each buffer's start is aligned to :data:`ALIGN_BYTES`, so
vectorized and Triton kernels see the alignment a separate allocation would give them; the
padding between views belongs to no parameter, and a select over a span may overwrite it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from muon_dist.state.tensors import local

ALIGN_BYTES = 16


def _padded(numel: int, itemsize: int) -> int:
    step = max(1, ALIGN_BYTES // itemsize)
    return -(-numel // step) * step


def zeros_like_flat(
    params: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype] | None = None
) -> list[torch.Tensor]:
    """Zeros like each parameter (a DTensor with its mesh and placements, or a plain
    tensor), in its dtype or its entry of ``dtypes`` (a momentum kept in another dtype than
    its parameter), whose local tensors are consecutive views of one buffer per dtype and
    device."""
    shards = [local(p) for p in params]
    kinds = [s.dtype for s in shards] if dtypes is None else list(dtypes)
    keys = [(dtype, s.device) for dtype, s in zip(kinds, shards, strict=True)]
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for key, shard in zip(keys, shards, strict=True):
        sizes[key] = sizes.get(key, 0) + _padded(shard.numel(), key[0].itemsize)
    buffers = {key: torch.zeros(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    zeros: list[torch.Tensor] = []
    for p, shard, key in zip(params, shards, keys, strict=True):
        start = offsets[key]
        offsets[key] += _padded(shard.numel(), key[0].itemsize)
        view = buffers[key][start : start + shard.numel()].view(shard.shape)
        if isinstance(p, DTensor):
            view = DTensor.from_local(
                view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        zeros.append(view)
    return zeros


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (a view into a flat buffer) that owns its storage, a DTensor again
    where ``t`` is one: what a saved state holds, since torch cannot pickle a DTensor whose
    local tensor is a view at an offset into a larger storage."""
    if isinstance(t, DTensor):
        return DTensor.from_local(
            t.to_local().clone(),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.clone()


@dataclass(frozen=True)
class Span:
    """Positions (into the caller's list) of tensors that lie in order in one storage, and
    ``flat``, the one-dimensional view from the first one's start to the last one's end;
    ``sizes`` splits ``flat`` into each tensor's elements followed by the padding before
    the next one (0 where there is none)."""

    members: tuple[int, ...]
    flat: torch.Tensor | None  # None for a lone tensor, which needs no span
    sizes: tuple[int, ...] = ()

    def split(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One-dimensional views of ``buffer`` (shaped like ``flat``), one per member."""
        return list(buffer.split_with_sizes(self.sizes)[::2])


def spans(tensors: Sequence[torch.Tensor]) -> list[Span]:
    """Split ``tensors`` into runs that lie in order in one storage: contiguous, one dtype,
    each starting where the previous one ends or after its alignment padding. A tensor that
    does not follow its neighbour starts a new run, so any list is accepted."""
    runs: list[list[int]] = []
    for index, t in enumerate(tensors):
        if runs and _follows(tensors[runs[-1][-1]], t):
            runs[-1].append(index)
        else:
            runs.append([index])
    result: list[Span] = []
    for run in runs:
        if len(run) == 1:
            result.append(Span((run[0],), None))
            continue
        first = tensors[run[0]]
        start = int(first.storage_offset())
        sizes: list[int] = []
        for index, following in zip(run, [*run[1:], None], strict=True):
            t = tensors[index]
            end = int(t.storage_offset() + t.numel())
            stop = end if following is None else int(tensors[following].storage_offset())
            sizes += [t.numel(), stop - end]
        flat = first.as_strided((sum(sizes),), (1,), start)
        result.append(Span(tuple(run), flat, tuple(sizes)))
    return result


def _follows(previous: torch.Tensor, t: torch.Tensor) -> bool:
    end = int(previous.storage_offset() + previous.numel())
    return (
        previous.is_contiguous()
        and t.is_contiguous()
        and t.dtype == previous.dtype
        and t.device == previous.device
        and t.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr()
        and end <= t.storage_offset() <= _padded(end, t.element_size())
    )
