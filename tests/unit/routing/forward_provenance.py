"""Which of a parameter's outputs each tensor of a forward holds: a structural proof of
a split.

A :class:`Provenance` mode follows one parameter through a forward. Where the parameter
(or an expert's slice of it, or its transpose) is applied (``F.linear`` reads its rows as
outputs; ``matmul``, ``bmm``, ``addmm`` its columns), the result gets a code per output
feature: the row index, or ``COLUMN`` plus the column index. Data movement (views,
reshapes, splits, chunks, indexing, transposes) and one-input ops that keep the shape
(activations, masks, scales) and a depthwise convolution (one filter per channel: Mamba's
``conv1d`` over x, B, C) carry the codes along. A split the routing makes is confirmed
when every part's codes are exactly those of some tensor of the forward: the forward
itself cut the output there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

COLUMN = 1 << 20
_MOVES = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "split",
    "chunk",
    "tensor_split",
    "unbind",
    "__getitem__",
    "unflatten",
    "flatten",
    "squeeze",
    "unsqueeze",
    "narrow",
    "select",
    "clone",
    "view_as",
    "expand",
}
_JOINS = {"cat", "concat", "stack"}
_APPLY_ROWS = {"linear"}
_APPLY_COLUMNS = {"matmul", "bmm", "mm", "addmm", "baddbmm", "__matmul__"}


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", ""))


class Provenance(TorchFunctionMode):
    """Records the output-feature code sets of every tensor derived from ``param``."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        rows, cols = param.shape[-2], param.shape[-1]
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            id(param): (torch.arange(rows), torch.arange(cols) + COLUMN)
        }
        self.codes: dict[int, torch.Tensor] = {}
        self.sets: set[frozenset[int]] = set()
        self.applied: set[str] = set()  # "rows" or "columns"
        self._alive: list[torch.Tensor] = []  # keeps ids unique while the forward runs

    def _track(self, tensor: torch.Tensor, codes: torch.Tensor) -> None:
        self.codes[id(tensor)] = codes
        self._alive.append(tensor)
        self.sets.add(frozenset(int(c) for c in codes.unique()))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        flat, _ = tree_flatten((args, kwargs))
        weights = [a for a in flat if isinstance(a, torch.Tensor) and id(a) in self.weights]
        if weights and isinstance(out, torch.Tensor):
            self._weight_op(name, func, args, weights[0], out)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        tracked = [a for a in tensors if id(a) in self.codes]
        if name == "conv1d" and len(tracked) == 1 and tracked[0] is args[0]:
            self._depthwise(args, kwargs, out)
        elif len(tracked) == 1 or (name in _JOINS and tracked and len(tracked) == len(tensors)):
            self._carry(name, func, args, kwargs, tracked, out)
        return out

    def _depthwise(self, args: Any, kwargs: Any, out: Any) -> None:
        """A convolution with one filter per channel keeps each channel: ``[b, C, L]``."""
        x = args[0]
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if isinstance(out, torch.Tensor) and groups == x.shape[1] == weight.shape[0]:
            self._track(out, self.codes[id(x)][:, :, :1].expand(out.shape))

    def _weight_op(
        self, name: str, func: Any, args: Any, weight: torch.Tensor, out: torch.Tensor
    ) -> None:
        rows, cols = self.weights[id(weight)]
        if name == "__getitem__" and out.ndim == weight.ndim - 1:  # one expert's matrix
            self.weights[id(out)] = (rows, cols)
            self._alive.append(out)
        elif name in ("transpose", "t", "__get__", "permute") and out.ndim == weight.ndim:
            self.weights[id(out)] = (cols, rows)
            self._alive.append(out)
        elif name in _APPLY_ROWS and args[1] is weight:
            self._applied(out, rows)
        elif name in _APPLY_COLUMNS and args[-1] is weight:
            self._applied(out, cols)

    def _applied(self, out: torch.Tensor, codes: torch.Tensor) -> None:
        """``out`` holds the outputs ``codes`` (rows or columns of the parameter)."""
        self.applied.add("columns" if int(codes[0]) >= COLUMN else "rows")
        self._track(out, codes.expand(out.shape))

    def _carry(
        self, name: str, func: Any, args: Any, kwargs: Any, sources: list[torch.Tensor], out: Any
    ) -> None:
        if name in _MOVES or name in _JOINS:

            def swap(a: Any) -> Any:
                return (
                    self.codes[id(a)]
                    if isinstance(a, torch.Tensor) and any(a is s for s in sources)
                    else a
                )

            try:
                moved = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            except RuntimeError:  # an op the codes cannot follow: the trail ends here
                return
            pairs = (
                zip(out, moved, strict=True) if isinstance(out, (tuple, list)) else [(out, moved)]
            )
            for tensor, code in pairs:
                if isinstance(tensor, torch.Tensor) and isinstance(code, torch.Tensor):
                    self._track(tensor, code)
        elif isinstance(out, torch.Tensor) and len(sources) == 1 and out.shape == sources[0].shape:
            self._track(out, self.codes[id(sources[0])])


def part_codes(options: dict[str, Any], rows: int) -> list[frozenset[int]]:
    """The codes of each part a route's view options cut a matrix's outputs into."""
    offset = COLUMN if options.get("transposed") else 0
    sizes = list(options["split_sizes"])
    groups = int(options.get("split_groups", 1))
    width = sum(sizes)
    found = []
    start = 0
    for size in sizes:
        found.append(
            frozenset(offset + g * width + start + i for g in range(groups) for i in range(size))
        )
        start += size
    assert width * groups == rows
    return found
