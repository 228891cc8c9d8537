"""Which parameters Muon orthogonalizes, and how each one is viewed as a batch of matrices.

Everything here is pure: it reads shapes, names and module types, never tensors' values, so
the same routing comes out on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from muon_dist.rules.scale import lr_scale as _shape_scale

logger = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]
"""A rectangular region of a tensor: one half-open (start, stop) per dimension."""

MUON_MODES = ("2d", "flat", "slice")
ALGORITHMS = ("muon", "adamw")


@dataclass(frozen=True)
class PartSplit:
    """Parts of every matrix of a view, orthogonalized separately on the owner.

    Along the matrix's output axis (rows, or columns when stored ``[in, out]``), a pattern of
    blocks of ``sizes`` repeats ``groups`` times; part ``j`` is block ``j`` of every repeat.
    ``groups=1`` is a contiguous split (gate then up), ``sizes=(1, 1)`` with ``groups=I``
    alternates rows (GPT-OSS gate/up), and torchtitan's fused QKV repeats
    ``(q_heads_per_kv * head_dim, head_dim, head_dim)`` once per key-value head. Each part's
    result is multiplied by its own lr scale, since its shape sets it.
    """

    sizes: tuple[int, ...]
    groups: int
    axis: int  # of a [k, rows, cols] stack: 1 splits rows, 2 splits columns
    scales: tuple[float, ...]

    def orthogonalize(
        self, stack: torch.Tensor, fn: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """``fn(part, j)`` on each part ``j`` of a ``[k, rows, cols]`` stack, handed over as
        ``[k, output rows, inputs]``; scaled, reassembled in place."""
        x = stack if self.axis == 1 else stack.transpose(1, 2)
        k, out_dim, in_dim = x.shape
        x = x.reshape(k, self.groups, out_dim // self.groups, in_dim)
        results, offset = [], 0
        for j, (size, scale) in enumerate(zip(self.sizes, self.scales, strict=True)):
            part = x[:, :, offset : offset + size].reshape(k, self.groups * size, in_dim)
            result = fn(part, j)
            result = result * scale if scale != 1.0 else result
            results.append(result.reshape(k, self.groups, size, in_dim))
            offset += size
        merged = torch.cat(results, dim=2).reshape(k, out_dim, in_dim)
        return (merged if self.axis == 1 else merged.transpose(1, 2)).contiguous()


@dataclass(frozen=True)
class MatrixView:
    """A parameter, or a block of its rows, seen as ``count`` matrices of ``rows x cols``.

    Matrix ``i`` covers a rectangular box of the full parameter, so shards can be intersected
    with it without ever materialising the view; a contiguous copy of the box reshapes to
    ``[k, rows, cols]``. A parameter cut by ``split_sizes`` has one view per row block, each
    starting at its ``row_offset``, or one view whose ``parts`` are cut on the owner.
    ``transposed`` matrices are stored ``[in, out]``: the lr scale reads their shape swapped.
    """

    kind: str  # "matrix" | "heads" | "expert_stack" | "fused_experts" | "flat" | "slice"
    shape: tuple[int, ...]
    count: int
    rows: int
    cols: int
    row_offset: int = 0
    transposed: bool = False
    parts: tuple[tuple[int, ...], int] | None = None  # (sizes, groups) of a PartSplit

    @property
    def dim0_step(self) -> int:
        """Dim-0 indices per matrix: one for stacks and slices, ``rows`` for row blocks."""
        return 1 if self.kind in ("expert_stack", "slice") else self.rows

    @property
    def numel(self) -> int:
        return self.count * self.rows * self.cols

    def box(self, start: int, stop: int) -> Box:
        """The region of the full parameter covered by matrices ``[start, stop)``."""
        first = self.row_offset + start * self.dim0_step
        last = self.row_offset + stop * self.dim0_step
        return ((first, last), *((0, s) for s in self.shape[1:]))

    def label(self, name: str) -> str:
        """``name``, with the row range when the view covers only part of the parameter."""
        first, last = self.box(0, self.count)[0]
        return name if (first, last) == (0, self.shape[0]) else f"{name}[{first}:{last}]"

    @property
    def out_in(self) -> tuple[int, int]:
        """Each matrix's (output, input) sizes, whatever its storage orientation."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    def lr_scale(self, adjust_lr: str | None) -> float:
        """Learning-rate multiplier from the full per-matrix shape, never a shard's; 1 for a
        view cut into parts, whose scales :meth:`part_split` applies."""
        if self.parts is not None:
            return 1.0
        return _shape_scale(*self.out_in, adjust_lr)

    def part_split(self, adjust_lr: str | None) -> PartSplit | None:
        """How the owner cuts each matrix into parts, with each part's lr scale."""
        if self.parts is None:
            return None
        sizes, groups = self.parts
        in_dim = self.out_in[1]
        scales = tuple(_shape_scale(groups * s, in_dim, adjust_lr) for s in sizes)
        return PartSplit(sizes, groups, 2 if self.transposed else 1, scales)

    def describe(self) -> str:
        text = f"{self.kind} {self.rows}x{self.cols}"
        if self.count > 1:
            text = f"{self.kind} {self.count}x[{self.rows}x{self.cols}]"
        if self.transposed:
            text += " in-out"
        if self.parts is not None:
            sizes, groups = self.parts
            cut = "+".join(str(s) for s in sizes)
            text += f" parts {cut}" + (f" x{groups} interleaved" if groups > 1 else "")
        return text


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def matrix_view(
    shape: Sequence[int],
    *,
    muon_mode: str = "2d",
    experts: bool = False,
    num_experts: int | None = None,
    num_heads: int | None = None,
    transposed: bool = False,
    name: str = "parameter",
) -> MatrixView:
    """Decide how a Muon parameter of ``shape`` splits into matrices, or explain why it can't."""
    view = _matrix_view(
        tuple(int(s) for s in shape), muon_mode, experts, num_experts, num_heads, name
    )
    if transposed:
        if view.kind == "heads":
            raise ValueError(
                f"{name}: num_heads={num_heads} cuts rows into heads, but transposed=True "
                "stores outputs as columns; drop one of them"
            )
        view = replace(view, transposed=True)
    return view


def _matrix_view(
    shape: tuple[int, ...],
    muon_mode: str,
    experts: bool,
    num_experts: int | None,
    num_heads: int | None,
    name: str,
) -> MatrixView:
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(
            f"{name} has shape {shape}: Muon needs >= 2-D parameters; put it in an "
            "'adamw' group (muon_dist.param_groups does this for you)"
        )
    if num_heads is not None:
        if num_experts is not None:
            raise ValueError(
                f"{name}: num_heads={num_heads!r} and num_experts={num_experts} both cut the "
                "rows into equal blocks; set only one of them"
            )
        if ndim != 2 or not is_positive_int(num_heads) or shape[0] % num_heads:
            raise ValueError(
                f"{name} has shape {shape} but its group sets num_heads={num_heads!r}; "
                "num_heads must be a positive int dividing the rows of a 2-D weight "
                "[num_heads * head_dim, in] (a list of head counts goes with split_sizes)"
            )
        if num_heads > 1:
            return MatrixView("heads", shape, num_heads, shape[0] // num_heads, shape[1])
    if num_experts is not None:
        if ndim != 2:
            raise ValueError(
                f"{name} has shape {shape} but its group sets num_experts={num_experts}; "
                "num_experts describes fused 2-D expert weights [E*m, n]"
            )
        if num_experts < 1 or shape[0] % num_experts:
            raise ValueError(
                f"{name} has {shape[0]} rows, not divisible by num_experts={num_experts}; "
                "fused expert weights must be [num_experts * rows, cols]"
            )
        rows = shape[0] // num_experts
        return MatrixView("fused_experts", shape, num_experts, rows, shape[1])
    if ndim == 2:
        return MatrixView("matrix", shape, 1, shape[0], shape[1])
    if ndim == 3 and experts:  # a stack stays one matrix per expert whatever muon_mode says
        return MatrixView("expert_stack", shape, shape[0], shape[1], shape[2])
    if muon_mode == "flat":
        return MatrixView("flat", shape, 1, shape[0], math.prod(shape[1:]))
    if muon_mode == "slice":
        return MatrixView("slice", shape, shape[0], shape[1], math.prod(shape[2:]))
    raise ValueError(
        f"{name} has shape {shape}, which muon_mode={muon_mode!r} does not orthogonalize: "
        "set experts=True in its group for a 3-D expert stack [E, m, n], or use "
        "muon_mode='flat' ([out, prod(rest)]) or muon_mode='slice' (one matrix per leading index)"
    )


def matrix_views(
    shape: Sequence[int], group: Mapping[str, Any], name: str = "parameter"
) -> list[MatrixView]:
    """The views of one Muon parameter under its group's options.

    One view, except with ``split_sizes`` on a plain 2-D ``[out, in]`` weight (QKV, gate+up):
    then one view per row block, each cut into ``num_heads[i]`` heads when ``num_heads`` is a
    list. On expert stacks, ``[in, out]`` storage (``transposed``) or a pattern repeated
    ``split_groups`` times (interleaved parts) the one view carries the parts instead, and
    the owner cuts each gathered matrix.
    """
    split = group.get("split_sizes")
    heads = group.get("num_heads")
    repeats = group.get("split_groups") or 1
    transposed = bool(group.get("transposed", False))
    shape = tuple(int(s) for s in shape)

    def whole(num_heads: int | None) -> MatrixView:
        return matrix_view(
            shape,
            muon_mode=group.get("muon_mode", "2d"),
            experts=group.get("experts", False),
            num_experts=group.get("num_experts"),
            num_heads=num_heads,
            transposed=transposed,
            name=name,
        )

    if split is None:
        if repeats != 1:
            raise ValueError(
                f"{name}: split_groups={repeats!r} repeats split_sizes, which is not set; "
                "set split_sizes (e.g. [1, 1] for alternating gate/up rows) or drop it"
            )
        return [whole(heads)]
    valid = isinstance(split, (list, tuple)) and all(is_positive_int(s) for s in split)
    if not valid or not is_positive_int(repeats):
        raise ValueError(
            f"{name}: split_sizes={split!r}, split_groups={repeats!r}; split_sizes must be a "
            "list of positive sizes and split_groups a positive int"
        )
    rows_split = len(shape) == 2 and not transposed and repeats == 1
    if rows_split and group.get("num_experts") is None:
        return _row_blocks(shape, list(split), heads, name)
    if heads is not None:
        raise ValueError(
            f"{name}: num_heads={heads!r} goes with split_sizes on a plain 2-D [out, in] "
            "weight only; drop num_heads here"
        )
    view = whole(None)
    out_dim = view.out_in[0]
    if sum(split) * repeats != out_dim:
        raise ValueError(
            f"{name} has shape {shape}: each matrix has {out_dim} outputs, but its group sets "
            f"split_sizes={list(split)} repeated split_groups={repeats} times "
            f"({sum(split) * repeats}); the parts must add up to the outputs"
        )
    return [replace(view, parts=(tuple(split), repeats))]


def _row_blocks(
    shape: tuple[int, ...], split: list[int], heads: Any, name: str
) -> list[MatrixView]:
    """One view per contiguous row block of a 2-D weight, optionally cut into heads."""
    if sum(split) != shape[0]:
        raise ValueError(
            f"{name} has {shape[0]} rows but its group sets split_sizes={split!r}; "
            "split_sizes must be positive row counts adding up to the rows, "
            "e.g. [q_rows, k_rows, v_rows]"
        )
    if heads is None:
        heads = [1] * len(split)
    elif not isinstance(heads, (list, tuple)) or len(heads) != len(split):
        raise ValueError(
            f"{name}: split_sizes={split} takes num_heads=None or a list of one head "
            f"count per block (e.g. [q_heads, kv_heads, kv_heads]), not num_heads={heads!r}"
        )
    views, offset = [], 0
    for i, (size, count) in enumerate(zip(split, heads, strict=True)):
        if not is_positive_int(count) or size % count:
            raise ValueError(
                f"{name}: block {i} of split_sizes={split} has {size} rows, not "
                f"divisible by num_heads[{i}]={count!r}"
            )
        kind = "heads" if count > 1 else "matrix"
        views.append(MatrixView(kind, shape, count, size // count, shape[1], offset))
        offset += size
    return views


def group_param_names(group: dict[str, Any], index: int) -> list[str]:
    """Names for error messages and tables: the group's own, else positional ones."""
    return group.get("param_names") or [
        f"group{index}.param{i}" for i in range(len(group["params"]))
    ]


def param_list(params: Any) -> list[Any]:
    """A list of parameters (or groups), in the order given; a set has none, so the ranks
    would list its parameters in different orders, and is refused as torch refuses it."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"Muon takes parameters in an ordered collection, got a {type(params).__name__}: "
            "a set's order differs between processes, so ranks would pair different tensors; "
            "pass a list, e.g. list(model.named_parameters()) or muon_dist.param_groups(model)"
        )
    return list(params)


def named_params(groups: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """``(name, group, param)`` for every parameter of ``groups``, in order, named as
    :func:`group_param_names` names them (a saved state's groups hold integer keys)."""
    for index, group in enumerate(groups):
        for name, p in zip(group_param_names(group, index), group["params"], strict=True):
            yield name, group, p
