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
    for dim in range(found.ndim):  # dims it repeats along (tokens, copies): one is enough
        first = found.narrow(dim, 0, 1)
        if found.shape[dim] > 1 and torch.equal(found, first.expand_as(found)):
            found = first
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
    its joins (the features of each join of its tensors), its mixes (features of its
    products combined elementwise) and whether it was ``merged``."""

    uses: set[str] = field(default_factory=set)
    merged: bool = False  # added to another parameter's product, then not followed
    cuts: dict[int, tuple[frozenset[int], list[frozenset[int]]]] = field(default_factory=dict)
    joins: list[frozenset[int]] = field(default_factory=list)
    mixes: list[tuple[frozenset[int], frozenset[int]]] = field(default_factory=list)

    def copy(self) -> Record:
        """A copy that what is recorded later leaves as it is (the feature sets are
        frozen: shared)."""
        cuts = {k: (held, list(pieces)) for k, (held, pieces) in self.cuts.items()}
        return Record(set(self.uses), self.merged, cuts, list(self.joins), list(self.mixes))

    def absorb(self, other: Record) -> None:
        """Add what ``other`` recorded (a twin's forward inside its block) to this."""
        self.uses |= other.uses
        self.merged |= other.merged
        self.cuts.update(other.cuts)
        self.joins += other.joins
        self.mixes += other.mixes


@dataclass(frozen=True)
class _Alias:
    """A parameter or a view, cast or scale of it: the codes of its last two dims."""

    index: int
    rows: torch.Tensor
    cols: torch.Tensor
    stacked: bool = False  # one matrix of a >2-D parameter, indexed along its first dim


@dataclass(frozen=True)
class _Grouped:
    """A 2-D parameter viewed as ``[g, a, b]``: ``g`` matrices, each a block of its rows
    (or, transposed, columns); ``rows`` ``[g, a]`` and ``cols`` ``[g, b]`` hold each
    matrix's codes. A grouped linear map (a ``Linear`` whose weight ``bmm`` applies one
    block per group) is one matrix per group."""

    index: int
    rows: torch.Tensor
    cols: torch.Tensor


# Moves of a grouped weight that keep its matrices (each transposed where they swap the
# last two dims).
_GROUP_KEEPS = frozenset({"contiguous", "clone", "to", "type_as", "float", "half", "bfloat16"})
_GROUP_VIEWS = frozenset({"view", "reshape", "unflatten", "view_as", "reshape_as"})


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
        self._maps = _WeightMaps(self)
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
        grouped = [a for a in flat if a in self._maps.grouped]
        if grouped:
            self._maps.op(name, args, kwargs, grouped[0], out)
        stacks = [a for a in flat if id(a) in self._stacks]
        if stacks:
            self._stack(name, args, stacks[0], out)
        tracked = [a for a in flat if a in self._codes]
        # A product that meets a parameter (a table added to it) is followed on, unless
        # the parameter's own use already gave the result its codes.
        if tracked and not (isinstance(out, torch.Tensor) and out in self._codes):
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
        elif name == "einsum" and self._maps.einsum(
            args, weight, alias.rows, alias.cols, None, out
        ):
            pass
        elif name in _GROUP_VIEWS and out.ndim == 3 and out.shape[0] > 1 and not alias.stacked:
            groups, size, width = out.shape
            if groups * size != alias.rows.numel() or width != alias.cols.numel():
                record.uses.add("table")
                return
            rows = alias.rows.reshape(groups, size)
            self._maps.grouped[out] = _Grouped(alias.index, rows, alias.cols.expand(groups, width))
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
            if not same:  # a product broadcast over the result (a term added per token)
                same = [t for t in tracked if _broadcasts(t.shape, out.shape)]
                same.sort(key=lambda t: -t.numel())
            # A 2-D weight's product before a stack's: the sum follows the one with parts.
            same.sort(key=lambda t: self._codes[t][2] <= self._stacked)
            if same:
                _, kept, params = self._codes[same[0]]
                self._mixed(kept, [t for t in same[1:] if t.shape == same[0].shape])
                if kept.shape != out.shape:
                    kept = kept.reshape((1,) * (out.ndim - kept.ndim) + tuple(kept.shape))
                    kept = kept.expand(out.shape)
                self._track(out, kept, params)
                for other in tracked:  # products added to another's: followed no further
                    for p in self._codes[other][2] - params:
                        self.records[p].merged = True

    def _mixed(self, kept: torch.Tensor, others: list[torch.Tensor]) -> None:
        """Products of one parameter combined elementwise where their features differ
        (``x1 * cos - x2 * sin`` of rotary halves, ``act(gate) * up``): noted as a mix, so
        that a join of the results (the rotated halves joined again) counts as a join of
        both (:mod:`muon_dist.routing.observation`)."""
        for other in others:
            codes = self._codes[other][1]
            if codes is kept or not self._codes[other][2]:
                continue
            mine = {(p, a): f for p, a, f in decode(kept)}
            for p, a, features in decode(codes):
                if (p, a) in mine and features != mine[(p, a)]:
                    self.records[p].mixes.append((mine[(p, a)], features))

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


class _WeightMaps:
    """The products of a tracer's 2-D weights that are not plain ``linear``/``matmul``
    calls: a weight viewed as groups (:class:`_Grouped`) and applied one block per group,
    and a weight applied by ``einsum``. Both are linear maps: a grouped one is one matrix
    per group (its groups are cut apart), never a table."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.grouped: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def op(self, name: str, args: Any, kwargs: Any, grouped: torch.Tensor, out: Any) -> None:
        """A grouped weight (:class:`_Grouped`) moved, or applied one matrix per group by
        ``bmm``, ``baddbmm``, ``matmul`` or ``einsum``: its outputs are the features of
        each group's matrix, and the groups are its parts. Anything else: a table."""
        g = self.grouped[grouped]
        record = self.tracer.records[g.index]
        if not isinstance(out, torch.Tensor):
            record.uses.add("table")
            return
        dims = {int(d) % 3 for d in args[1:3] if isinstance(d, int)}
        if (name in ("transpose", "swapaxes") and dims == {1, 2}) or name == "mT":
            self.grouped[out] = _Grouped(g.index, g.cols, g.rows)
        elif name == "permute" and tuple(args[1:]) in (((0, 2, 1),), (0, 2, 1)):
            self.grouped[out] = _Grouped(g.index, g.cols, g.rows)
        elif name in _GROUP_KEEPS and tuple(out.shape) == tuple(grouped.shape):
            self.grouped[out] = g
        elif name == "__getitem__" and out.ndim == 2 and _one_index(args[1]) is not None:
            k = _one_index(args[1])  # one group's matrix (DBRX's w1.view(E, m, n)[e])
            self.tracer._aliases[out] = _Alias(g.index, g.rows[k], g.cols[k])
        elif name == "einsum" and self.einsum(args, grouped, g.rows, g.cols, True, out):
            pass
        elif name in ("bmm", "matmul", "__matmul__") and len(args) == 2 and out.ndim == 3:
            if args[1] is grouped:  # x @ W_g: each group's columns are its outputs
                self.product(record, g.index, g.cols[:, None, :], out)
            else:  # W_g @ x: its rows
                self.product(record, g.index, g.rows[:, :, None], out)
        elif name == "baddbmm" and args[-1] is grouped and out.ndim == 3:
            self.product(record, g.index, g.cols[:, None, :], out)
        else:
            record.uses.add("table")

    def product(self, record: Record, index: int, codes: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` holds each group's outputs ``codes`` (laid out as ``out``, groups first):
        a linear map whose groups are cut apart."""
        axis = int(codes.flatten()[0]) >> _AXIS & 1 if codes.numel() else 0
        record.uses.add("columns" if axis else "rows")
        per_group = [frozenset((c & _FEATURES).flatten().tolist()) for c in codes]
        whole = frozenset().union(*per_group)
        record.cuts[next(self.tracer._serial)] = (whole, per_group)
        self.tracer._track(out, codes.expand(out.shape), frozenset({index}))

    def einsum(
        self,
        args: Any,
        weight: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        grouped: bool | None,
        out: torch.Tensor,
    ) -> bool:
        """An einsum that applies ``weight`` (a 2-D parameter, or ``grouped``: one matrix
        per group, its first index) as a linear map: one of its matrix indices kept in the
        output, the other contracted (and the group index kept). Its product gets the codes
        of the kept index; False where the einsum is no such map."""
        equation = args[0] if isinstance(args[0], str) else ""
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        lhs, _, output = re.sub(r"\s", "", equation).partition("->")
        terms = lhs.split(",")
        place = next((i for i, o in enumerate(operands) if o is weight), None)
        if place is None or "." in lhs or not output or len(terms) != len(operands):
            return False
        term = terms[place]
        matrix = term[1:] if grouped else term
        if len(matrix) != 2 or (grouped and term[0] not in output):
            return False
        kept = [c for c in matrix if c in output]
        if len(kept) != 1:
            return False
        codes = rows if kept[0] == matrix[0] else cols  # [n] or, grouped, [g, n]
        record = self.tracer.records[self.index_of(weight)]
        order = sorted(((output.index(c), k) for k, c in enumerate(term) if c in output))
        layout = [1] * out.ndim
        for position, k in order:
            layout[position] = int(weight.shape[k])
        if grouped:
            feature_first = output.index(kept[0]) < output.index(term[0])
            codes = codes.t() if feature_first else codes
            self.product(record, self.index_of(weight), codes.reshape(layout), out)
            return True
        axis = int(codes.flatten()[0]) >> _AXIS & 1 if codes.numel() else 0
        record.uses.add("columns" if axis else "rows")
        held = codes.reshape(layout).expand(out.shape)
        self.tracer._track(out, held, frozenset({self.index_of(weight)}))
        return True

    def index_of(self, weight: torch.Tensor) -> int:
        found = (
            self.tracer._aliases[weight] if weight in self.tracer._aliases else self.grouped[weight]
        )
        return int(found.index)


def _one_index(index: Any) -> int | None:
    """An index that picks one entry of the first dim: an int or a 0-d integer tensor
    with a value (not on meta)."""
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if isinstance(index, torch.Tensor) and index.ndim == 0 and not index.is_meta:
        if not index.dtype.is_floating_point and index.dtype != torch.bool:
            with torch._C.DisableTorchFunction():
                return int(index)
    return None


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (in an elementwise op)."""
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(to), strict=False))


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
