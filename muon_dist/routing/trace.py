"""Follow every matrix parameter's product through one forward, on the meta device.

A :class:`Tracer` is a torch function mode. Where a parameter (or a transpose, slice or
cast of it) is applied as a linear map (``F.linear`` reads its rows as outputs, ``x @ W``
its columns), the product gets a code per output feature: the parameter's index, its axis
and the feature. Data movement (views, splits, chunks, indexing, transposes, joins) is
replayed on the codes, which are small CPU tensors, so every tensor derived from the
product knows which outputs it holds; ops that keep the shape (elementwise ops, norms, a
depthwise convolution over channels) carry them along. A cut (a move whose result holds
fewer of a parameter's outputs than its source) and a join are recorded, per parameter,
as sets of features; :mod:`muon_dist.routing.observation` turns them into parts. Everything
else a parameter takes part in (indexed, added, expanded) makes it a table.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

# A code: parameter index << _PARAM | axis << _AXIS | feature (axis 1: the columns).
_AXIS = 30
_PARAM = 31
_FEATURES = (1 << _AXIS) - 1
# The codes of a stack's product: no feature is followed (a stack has no parts), only
# which parameter it came from, so that a product reaching an output makes a head.
_NO_FEATURE = torch.tensor(-1, dtype=torch.int64)

_MOVES = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "swapaxes",
        "permute",
        "movedim",
        "contiguous",
        "split",
        "split_with_sizes",
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
        "reshape_as",
        "expand",
        "expand_as",
        "repeat",
        "repeat_interleave",
        "flip",
        "roll",
        "t",
        "__get__",
    }
)
# Moves that keep every output they are given: no cut to look for.
_KEEPING = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "swapaxes",
        "permute",
        "movedim",
        "contiguous",
        "unflatten",
        "flatten",
        "squeeze",
        "unsqueeze",
        "clone",
        "view_as",
        "reshape_as",
        "expand",
        "expand_as",
        "t",
        "T",
        "mT",
    }
)
_JOINS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack"})
# Ops that mix features (or tokens) even where the shape is kept: the trail ends there.
_MIXING = frozenset(
    {
        "linear",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "einsum",
        "bilinear",
        "scaled_dot_product_attention",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "softmax",
        "log_softmax",
        "gather",
        "index_select",
        "take_along_dim",
        "scatter",
        "index_add",
    }
)
# Ops that keep a stack of matrices a stack of the same matrices: a selection along its
# first dim (MoshiFlexibleLinear's ``index_select``), each matrix transposed, leading unit
# dims, a cast or a copy.
_STACK_MOVES = frozenset(
    {
        "index_select",
        "__getitem__",
        "transpose",
        "swapaxes",
        "mT",
        "unsqueeze",
        "contiguous",
        "clone",
        "to",
        "type_as",
        "float",
        "half",
        "bfloat16",
    }
)
_CONVS = frozenset({"conv1d", "conv2d", "conv3d"})
_BATCHED = frozenset({"bmm", "baddbmm"})
_MATMULS = frozenset({"matmul", "__matmul__", "mm", "bmm"})


def code_of(param: int, axis: int, features: torch.Tensor) -> torch.Tensor:
    return (param << _PARAM) | (axis << _AXIS) | features


def _compact(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` without the dims it is broadcast along (tokens, batch): same features."""
    for dim in range(codes.ndim - 1, -1, -1):
        if codes.stride(dim) == 0 and codes.shape[dim] > 1:
            codes = codes.narrow(dim, 0, 1)
    return codes


def decode(codes: torch.Tensor) -> Iterator[tuple[int, int, frozenset[int]]]:
    """``(parameter, axis, features)`` for each parameter axis among ``codes``."""
    found = _compact(codes)
    found = found[found >= 0].flatten().sort().values
    if not found.numel():
        return
    fresh = torch.ones_like(found, dtype=torch.bool)
    fresh[1:] = found[1:] != found[:-1]
    found = found[fresh]
    keys = found >> _AXIS
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    for key in keys[first].tolist():
        features = found[keys == key] & _FEATURES
        yield key >> 1, key & 1, frozenset(features.tolist())


@dataclass
class Record:
    """What one forward showed about one parameter: how it was applied (``"rows"``,
    ``"columns"``: a linear map reading those as outputs; ``"slice"``, ``"flat"``: a
    stack of matrices or one flattened matrix; ``"table"``: indexed, added or expanded;
    ``"other"``), its cuts (per source tensor: the source's features and each piece's)
    its joins (the features of each join of its tensors) and whether it was ``merged``."""

    uses: set[str] = field(default_factory=set)
    merged: bool = False  # added to another parameter's product, then not followed
    cuts: dict[int, tuple[frozenset[int], list[frozenset[int]]]] = field(default_factory=dict)
    joins: list[frozenset[int]] = field(default_factory=list)

    def copy(self) -> Record:
        """A copy that what is recorded later leaves as it is (the feature sets are
        frozen: shared)."""
        cuts = {k: (held, list(pieces)) for k, (held, pieces) in self.cuts.items()}
        return Record(set(self.uses), self.merged, cuts, list(self.joins))

    def absorb(self, other: Record) -> None:
        """Add what ``other`` recorded (a twin's forward inside its block) to this."""
        self.uses |= other.uses
        self.merged |= other.merged
        self.cuts.update(other.cuts)
        self.joins += other.joins


@dataclass(frozen=True)
class _Alias:
    """A parameter or a view, cast or scale of it: the codes of its last two dims."""

    index: int
    rows: torch.Tensor
    cols: torch.Tensor
    stacked: bool = False  # one matrix of a >2-D parameter, indexed along its first dim


def _name(func: Any) -> str:
    name = str(getattr(func, "__name__", ""))
    if name == "__get__":
        return str(getattr(getattr(func, "__self__", None), "__name__", "__get__"))
    return name


class Tracer(TorchFunctionMode):
    """Records, per parameter of ``params`` (by position), how the forward uses it."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.records = [Record() for _ in range(count)]
        self._aliases: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._codes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._serial = itertools.count()
        self._stacks: dict[int, int] = {}  # id of a >2-D parameter or a move of it -> index
        self._stacked: set[int] = set()  # the indices of the >2-D parameters
        self._kept: list[torch.Tensor] = []
        self.outputs: set[int] = set()
        self.paused = 0  # > 0: ops run unobserved (a twin's forward, see forward.py)

    def fresh(self, inputs: Any) -> Any:
        """``inputs`` with each product swapped for an alias that holds no codes: a product
        entering a repeated block is not followed inside it, so that every instance of the
        block is observed alike (and one can stand for its twins)."""
        self.paused += 1
        try:
            return tree_map(
                lambda a: (
                    a.view(a.shape) if isinstance(a, torch.Tensor) and a in self._codes else a
                ),
                inputs,
            )
        finally:
            self.paused -= 1

    def carried(self, out: Any) -> list[tuple[torch.Tensor, frozenset[int]] | None]:
        """The codes and parameters that each tensor of ``out`` holds (None: nothing)."""
        return [
            self._codes[t][1:] if isinstance(t, torch.Tensor) and t in self._codes else None
            for t in tree_flatten(out)[0]
        ]

    def carry(
        self,
        out: Any,
        carried: list[tuple[torch.Tensor, frozenset[int]] | None],
        remap: dict[int, int],
    ) -> None:
        """Give the tensors of ``out`` (a twin's outputs) what a traced twin's held, its
        parameters renumbered by ``remap``; a tensor of another shape gets nothing. The
        renumbering is not the model's: the mode is off for it (it would cost more)."""
        with torch._C.DisableTorchFunction():
            lookup = torch.arange(len(self.records))
            lookup[list(remap)] = torch.tensor(list(remap.values()), dtype=torch.long)
            for tensor, held in zip(tree_flatten(out)[0], carried, strict=False):
                if held is None or not isinstance(tensor, torch.Tensor):
                    continue
                codes, params = held
                if tuple(codes.shape) != tuple(tensor.shape):
                    continue
                small = _compact(codes)
                owner = lookup[(small >> _PARAM).clamp(min=0)]
                renumbered = torch.where(
                    small >= 0, owner << _PARAM | small & ((1 << _PARAM) - 1), small
                )
                self._track(
                    tensor,
                    renumbered.expand(codes.shape),
                    frozenset(remap.get(p, p) for p in params),
                )

    def is_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter's stand-in or a view, cast or matrix of one."""
        return tensor in self._aliases or id(tensor) in self._stacks

    def param(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Follow ``tensor`` as parameter ``index`` (its meta stand-in); returns it."""
        if tensor.ndim == 2:
            rows, cols = torch.arange(tensor.shape[0]), torch.arange(tensor.shape[1])
            self._aliases[tensor] = _Alias(index, code_of(index, 0, rows), code_of(index, 1, cols))
        elif tensor.ndim > 2:
            self._stacks[id(tensor)] = index
            self._stacked.add(index)
            self._kept.append(tensor)  # keeps its id its own while the forward runs
        return tensor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = _name(func)
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        aliases = [a for a in flat if a in self._aliases]
        if aliases:
            self._weight(name, func, args, kwargs, aliases, flat, out)
        stacks = [a for a in flat if id(a) in self._stacks]
        if stacks:
            self._stack(name, args, stacks[0], out)
        tracked = [a for a in flat if a in self._codes]
        if tracked and not aliases:
            self._follow(name, func, args, kwargs, tracked, flat, out)
        return out

    # -- parameters -----------------------------------------------------------------------

    def _weight(
        self,
        name: str,
        func: Callable[..., Any],
        args: Any,
        kwargs: Any,
        aliases: list[torch.Tensor],
        flat: list[torch.Tensor],
        out: Any,
    ) -> None:
        weight = aliases[0]
        alias = self._aliases[weight]
        record = self.records[alias.index]
        if not isinstance(out, torch.Tensor):
            return
        operands = [a for a in flat if a is not weight]
        if name == "linear" and len(args) > 1 and args[1] is weight:
            self._applied(record, alias, out, alias.rows)
        elif name in ("addmm", "baddbmm") and args[-1] is weight:
            self._applied(record, alias, out, alias.cols)
        elif name in _MATMULS and len(args) == 2 and args[1] is weight and args[0] is not weight:
            self._applied(record, alias, out, alias.cols)
        elif name in _MATMULS and len(args) == 2 and args[0] is weight and args[1] is not weight:
            self._applied(record, alias, out, alias.rows[:, None])
        elif name in ("t", "T", "mT", "transpose", "swapaxes") and out.ndim == 2:
            self._aliases[out] = _Alias(alias.index, alias.cols, alias.rows, alias.stacked)
        elif tuple(out.shape[-2:]) == tuple(weight.shape[-2:]) and not any(
            o in self._codes or o.shape == out.shape for o in operands
        ):  # a cast, copy, scale or leading unit dims: the same matrix
            self._aliases[out] = alias
        elif name == "__getitem__" and out.ndim == 2:
            self._sliced(weight, alias, args[1], out, record)
        else:
            record.uses.add("table")

    def _sliced(
        self, weight: torch.Tensor, alias: _Alias, index: Any, out: torch.Tensor, record: Record
    ) -> None:
        """``W[a:b]`` or ``W[:, a:b]``: the same map on fewer features; else a table."""
        keys = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(k, slice) for k in keys):
            record.uses.add("table")
            return
        rows = alias.rows[keys[0]] if keys else alias.rows
        cols = alias.cols[keys[1]] if len(keys) > 1 else alias.cols
        self._aliases[out] = _Alias(alias.index, rows, cols, alias.stacked)

    def _stack(self, name: str, args: Any, stack: torch.Tensor, out: Any) -> None:
        """A >2-D parameter: indexed to one matrix then applied, or applied batched along
        its first dim (``"slice"``), also after moves that keep it a stack of its
        matrices; one einsum contracting its first dim or all the others (``"flat"``);
        anything else (``"other"``)."""
        index = self._stacks[id(stack)]
        record = self.records[index]
        if name == "__getitem__" and isinstance(args[1], int) and isinstance(out, torch.Tensor):
            if out.ndim == 2:  # one matrix of the stack: followed as an alias
                rows, cols = torch.arange(out.shape[0]), torch.arange(out.shape[1])
                self._aliases[out] = _Alias(index, rows, cols, stacked=True)
                return
        moved = name in _STACK_MOVES and isinstance(out, torch.Tensor)
        if moved and _same_stack(name, args, stack, out):
            self._stacks[id(out)] = index
            self._kept.append(out)
            return
        if name in _BATCHED or (name in _MATMULS and _one_stack(stack)):
            record.uses.add("slice")
            if isinstance(out, torch.Tensor):
                self._track(out, _NO_FEATURE.expand(out.shape), frozenset({index}))
        elif name == "einsum":
            record.uses.add(_einsum_use(args, stack))
        else:
            record.uses.add("other")

    def _applied(
        self, record: Record, alias: _Alias, out: torch.Tensor, codes: torch.Tensor
    ) -> None:
        """``out`` holds the outputs ``codes``: the parameter's rows or its columns."""
        axis = int(codes.flatten()[0]) >> _AXIS & 1 if codes.numel() else 0
        record.uses.add("slice" if alias.stacked else ("columns" if axis else "rows"))
        held = _NO_FEATURE if alias.stacked else codes
        self._track(out, held.expand(out.shape), frozenset({alias.index}))

    # -- products -------------------------------------------------------------------------

    def _track(self, tensor: torch.Tensor, codes: torch.Tensor, params: frozenset[int]) -> None:
        """``tensor`` holds ``codes``, outputs of (at most) the parameters ``params``."""
        self._codes[tensor] = (next(self._serial), codes, params)

    def _follow(
        self,
        name: str,
        func: Callable[..., Any],
        args: Any,
        kwargs: Any,
        tracked: list[torch.Tensor],
        flat: list[torch.Tensor],
        out: Any,
    ) -> None:
        if name in _CONVS and _depthwise(args, kwargs) and isinstance(out, torch.Tensor):
            _, codes, params = self._codes[args[0]]
            self._track(out, codes[..., :1].expand(out.shape), params)
        elif name in _MOVES and len(tracked) == 1:
            self._move(func, args, kwargs, tracked[0], out, cuts=name not in _KEEPING)
        elif name in _JOINS:
            self._join(func, args, kwargs, out)
        elif name not in _MIXING and isinstance(out, torch.Tensor):
            same = [t for t in tracked if t.shape == out.shape]
            # A 2-D weight's product before a stack's: the sum follows the one with parts.
            same.sort(key=lambda t: self._codes[t][2] <= self._stacked)
            if same:
                _, kept, params = self._codes[same[0]]
                self._track(out, kept, params)
                for other in tracked:  # products added to another's: followed no further
                    for p in self._codes[other][2] - params:
                        self.records[p].merged = True

    def _replay(self, func: Callable[..., Any], args: Any, kwargs: Any, fill: bool) -> Any:
        """``func`` on the codes of its tracked arguments (untracked tensors: -1 codes
        where ``fill``); None where the codes cannot follow (meta indices, a mask)."""

        def swap(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            if a in self._codes:
                return self._codes[a][1]
            return torch.full(a.shape, -1, dtype=torch.int64) if fill else a

        swapped = tree_map(swap, (args, kwargs))
        if any(t.is_meta for t in tree_flatten(swapped)[0] if isinstance(t, torch.Tensor)):
            return None  # a meta index or mask: the codes cannot follow it
        for attempt in range(2):
            try:
                return func(*swapped[0], **swapped[1])
            except (RuntimeError, NotImplementedError, IndexError, TypeError, ValueError):
                if attempt:  # an op the codes cannot follow: the trail ends here
                    return None
            swapped = tree_map(
                lambda a: a.contiguous() if isinstance(a, torch.Tensor) else a, swapped
            )
        return None

    def _move(
        self,
        func: Callable[..., Any],
        args: Any,
        kwargs: Any,
        source: torch.Tensor,
        out: Any,
        cuts: bool,
    ) -> None:
        moved = self._replay(func, args, kwargs, fill=False)
        if moved is None:
            return
        serial, codes, params = self._codes[source]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        pieces = list(moved) if isinstance(moved, (tuple, list)) else [moved]
        whole = {(p, a): f for p, a, f in decode(codes)} if cuts else {}
        for tensor, piece in zip(outs, pieces, strict=False):
            if not isinstance(tensor, torch.Tensor) or not isinstance(piece, torch.Tensor):
                continue
            self._track(tensor, piece, params)
            for p, a, features in decode(piece) if cuts else ():
                held = whole.get((p, a))
                if held is not None and features != held:  # fewer outputs: a cut
                    self.records[p].cuts.setdefault(serial, (held, []))[1].append(features)

    def _join(self, func: Callable[..., Any], args: Any, kwargs: Any, out: Any) -> None:
        joined = self._replay(func, args, kwargs, fill=True)
        if not isinstance(joined, torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        params = frozenset().union(
            *(
                self._codes[a][2]
                for a in tree_flatten((args, kwargs))[0]
                if isinstance(a, torch.Tensor) and a in self._codes
            )
        )
        self._track(out, joined, params)
        for p, _, features in decode(joined):
            self.records[p].joins.append(features)

    def reached(self, output: torch.Tensor) -> None:
        """Note the parameters whose products ``output`` (a model output) holds."""
        if output in self._codes:
            self.outputs |= self._codes[output][2]


def _depthwise(args: Any, kwargs: Any) -> bool:
    """A convolution with one filter per channel: it keeps each channel's identity."""
    groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    x = args[0]
    if not isinstance(weight, torch.Tensor) or not isinstance(x, torch.Tensor):
        return False
    return bool(groups > 1 and groups == x.shape[1] == weight.shape[0])


def _one_stack(t: torch.Tensor) -> bool:
    """``[n, a, b]`` with leading unit dims at most: one stack of matrices, which a matmul
    applies one per index of its first dim (its batch dim)."""
    return t.ndim >= 3 and math.prod(t.shape[:-3]) == 1


def _same_stack(name: str, args: Any, stack: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out``, made from ``stack`` by the move ``name``, is a stack of the same
    matrices: some of them (selected along the stack's dim), each transposed (its last
    two dims swapped), or all of them with leading unit dims or another dtype."""
    if not (_one_stack(stack) and _one_stack(out)):
        return False
    sides = tuple(stack.shape[-2:])
    dims = {int(d) % stack.ndim for d in args[1:3] if isinstance(d, int)}  # positional dims
    if name in ("transpose", "swapaxes"):
        swapped = dims == {stack.ndim - 1, stack.ndim - 2}
        return swapped and tuple(out.shape[-2:]) == sides[::-1]
    if name == "mT":
        return True
    if name == "index_select":
        return len(args) > 1 and dims == {stack.ndim - 3} and tuple(out.shape[-2:]) == sides
    return tuple(out.shape[-2:]) == sides


def _einsum_use(args: Any, stack: torch.Tensor) -> str:
    """How an einsum reads a >2-D parameter: ``"slice"`` where its first index is a batch
    index (in the output and in another operand), ``"flat"`` where it contracts its first
    index alone or all the others, else ``"other"``."""
    equation = args[0] if isinstance(args[0], str) else ""
    operands = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) else args[1]
    lhs, _, output = re.sub(r"\s", "", equation).partition("->")
    terms = lhs.split(",")
    place = next((i for i, o in enumerate(operands) if o is stack), None)
    if place is None or not output or len(terms) != len(operands):
        return "other"
    own = terms[place]
    others = "".join(t for i, t in enumerate(terms) if i != place)
    contracted = {c for c in own if c not in output}
    if own[0] in output and own[0] in others:
        return "slice"
    if contracted in ({own[0]}, set(own[1:])):
        return "flat"
    return "other"
