"""Dion2's selected elements moved between 2-D tensors and flat buffers in one Triton
launch for many rectangles (an address table), where torch takes one indexing launch per
rectangle. Importing this module imports Triton; the optimizer reaches it through
:mod:`muon_dist.runtime.selected_bucket` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from muon_dist.kernels.availability import on_device
from muon_dist.kernels.tables import address_table
from muon_dist.kernels.triton_elementwise import TL_DTYPES

_BLOCK = 2048
_PROGRAMS = 1024  # per rectangle; each takes every _PROGRAMS-th block of it


class RectMove(NamedTuple):
    """The elements of a 2-D ``plane`` (unit column stride) at ``rows[i] x cols[i]`` for
    each group i of ``shape = (g, a, b)`` (None: all rows or columns, in order, one group),
    and the contiguous ``flat`` buffer that holds them ``[g, a, b]``."""

    flat: torch.Tensor
    plane: torch.Tensor
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    shape: tuple[int, int, int]


@triton.jit
def _move_rects_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    table_ptr,
    FLAT: tl.constexpr,
    PLANE: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, j) takes every ``programs``-th block of the i-th rectangle of ``table``
    (flat, plane, rows and cols addresses (0: none), g, a, b, the plane's row stride):
    ``flat ← plane[rect]`` (GATHER) or ``plane[rect] ← flat``, cast to the destination's
    dtype."""
    row = table_ptr + tl.program_id(0) * 8
    flat_ptr = tl.load(row).to(tl.pointer_type(FLAT))
    plane_ptr = tl.load(row + 1).to(tl.pointer_type(PLANE))
    rows_address = tl.load(row + 2)
    cols_address = tl.load(row + 3)
    rows_ptr = rows_address.to(tl.pointer_type(tl.int64))
    cols_ptr = cols_address.to(tl.pointer_type(tl.int64))
    a = tl.load(row + 5)
    b = tl.load(row + 6)
    numel = tl.load(row + 4) * a * b
    stride = tl.load(row + 7)
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(tl.program_id(1).to(tl.int64) * BLOCK, numel, step):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        group = offsets // (a * b)
        i = (offsets // b) % a
        j = offsets % b
        r = i
        if rows_address != 0:
            r = tl.load(rows_ptr + group * a + i, mask=mask, other=0)
        c = j
        if cols_address != 0:
            c = tl.load(cols_ptr + group * b + j, mask=mask, other=0)
        at = r * stride + c
        if GATHER:
            values = tl.load(plane_ptr + at, mask=mask)
            tl.store(flat_ptr + offsets, values.to(FLAT), mask=mask)
        else:
            values = tl.load(flat_ptr + offsets, mask=mask)
            tl.store(plane_ptr + at, values.to(PLANE), mask=mask)


def move_rects_triton(moves: Sequence[RectMove], gather: bool) -> None:
    """Every move's elements ``flat ← plane`` (``gather``) or ``plane ← flat``, one launch
    per pair of dtypes. Not while a graph is captured: its address table would be read
    again at every replay."""
    batches: dict[tuple[torch.dtype, torch.dtype], list[list[int]]] = {}
    device = None
    for move in moves:
        g, a, b = move.shape
        if not g * a * b:
            continue
        if move.plane.stride(1) != 1:
            raise ValueError(
                f"a plane's columns must be contiguous; its strides are {move.plane.stride()}"
            )
        device = move.flat.device
        batches.setdefault((move.flat.dtype, move.plane.dtype), []).append(
            [
                move.flat.data_ptr(),
                move.plane.data_ptr(),
                0 if move.rows is None else move.rows.data_ptr(),
                0 if move.cols is None else move.cols.data_ptr(),
                g,
                a,
                b,
                move.plane.stride(0),
            ]
        )
    if device is None:
        return
    with on_device(device):
        for (flat, plane), rows in batches.items():
            blocks = max(triton.cdiv(row[4] * row[5] * row[6], _BLOCK) for row in rows)
            _move_rects_kernel[(len(rows), min(blocks, _PROGRAMS))](
                address_table(rows, device),
                FLAT=TL_DTYPES[flat],
                PLANE=TL_DTYPES[plane],
                GATHER=gather,
                BLOCK=_BLOCK,
                num_warps=8,
            )
