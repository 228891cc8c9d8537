"""Which parameters Muon orthogonalizes, and how each one is viewed as a batch of matrices.

Everything here is pure: it reads shapes, names and module types, never tensors' values, so
the same routing comes out on every rank.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from muon_dist.update_rule import lr_scale as _shape_scale

logger = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]
"""A rectangular region of a tensor: one half-open (start, stop) per dimension."""

MUON_MODES = ("2d", "flat", "slice")
ADJUST_LR = ("spectral_norm", "rms_norm", None)
ALGORITHMS = ("muon", "adamw")

# Parts that wrappers (torch.compile, activation checkpointing, FSDP1, DDP) insert into names.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def normalize_fqn(name: str) -> str:
    """Strip wrapper-inserted name parts so routing patterns see the model's own names."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


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
        self, stack: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn`` on each part of a ``[k, rows, cols]`` stack, scaled, reassembled in place."""
        x = stack if self.axis == 1 else stack.transpose(1, 2)
        k, out_dim, in_dim = x.shape
        x = x.reshape(k, self.groups, out_dim // self.groups, in_dim)
        results, offset = [], 0
        for size, scale in zip(self.sizes, self.scales, strict=True):
            part = x[:, :, offset : offset + size].reshape(k, self.groups * size, in_dim)
            result = fn(part)
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
    if muon_mode == "flat":
        return MatrixView("flat", shape, 1, shape[0], math.prod(shape[1:]))
    if muon_mode == "slice" or (ndim == 3 and experts):
        kind = "expert_stack" if experts else "slice"
        return MatrixView(kind, shape, shape[0], shape[1], math.prod(shape[2:]))
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


@dataclass(frozen=True)
class RouteEntry:
    """One row of the routing table; ``lr_scales`` has one entry per part of the view."""

    name: str
    shape: tuple[int, ...]
    algorithm: str
    view: str
    lr_scales: tuple[float, ...]
    numel: int

    @property
    def scale_text(self) -> str:
        return "/".join(f"{s:.3f}" for s in self.lr_scales) if self.algorithm == "muon" else "-"


def format_routing_table(entries: Iterable[RouteEntry]) -> str:
    """Render routing rows as an aligned text table with per-algorithm totals in millions."""
    rows = [("name", "shape", "algorithm", "matrix view", "lr scale", "params (M)")]
    totals: dict[str, int] = {}
    for e in entries:
        shape = "x".join(str(s) for s in e.shape) or "scalar"
        rows.append((e.name, shape, e.algorithm, e.view, e.scale_text, f"{e.numel / 1e6:.2f}"))
        totals[e.algorithm] = totals.get(e.algorithm, 0) + e.numel
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    summary = ", ".join(f"{alg}: {n / 1e6:.2f}M" for alg, n in sorted(totals.items()))
    lines.append(f"total {summary}")
    return "\n".join(lines)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def _adamw_modules(
    model: nn.Module, head_patterns: Sequence[str], embedding_patterns: Sequence[str]
) -> set[int]:
    """Ids of parameters owned by embedding tables and output heads."""
    ids: set[int] = set()
    for mod_name, module in model.named_modules():
        name = normalize_fqn(mod_name)
        is_embedding = isinstance(module, nn.Embedding) or _matches(name, embedding_patterns)
        is_head = isinstance(module, nn.Linear) and _matches(name, head_patterns)
        if is_embedding or is_head:
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


Override = Callable[[str, torch.Tensor], str | None] | Mapping[str, str]
"""Routing overrides: ``(name, param) -> "muon" | "adamw" | None``, or name regex -> algorithm."""

FUSED_KEYS = ("split_sizes", "num_heads", "split_groups", "transposed")
EXPERT_KEYS = ("experts", "routed_experts")


class _Overrides:
    """Both override forms as one callable; a mapping's first matching pattern wins, and
    :meth:`unmatched` lists the patterns that matched no parameter."""

    def __init__(self, overrides: Override | None) -> None:
        self.fn = overrides if callable(overrides) else None
        self.patterns = dict(overrides) if isinstance(overrides, Mapping) else {}
        for pattern, algorithm in self.patterns.items():
            if algorithm not in ALGORITHMS:
                raise ValueError(
                    f"overrides[{pattern!r}]={algorithm!r}; choose one of {list(ALGORITHMS)}"
                )
        self.hits: set[str] = set()

    def __call__(self, name: str, p: torch.Tensor) -> str | None:
        if self.fn is not None:
            return self.fn(name, p)
        for pattern, algorithm in self.patterns.items():
            if re.search(pattern, name):
                self.hits.add(pattern)
                return algorithm
        return None

    def unmatched(self) -> list[str]:
        return [p for p in self.patterns if p not in self.hits]


def _fused_pattern(name: str, fused: Mapping[str, Mapping[str, Any]]) -> str | None:
    hits = [pattern for pattern in fused if re.search(pattern, name)]
    if len(hits) > 1:
        raise ValueError(f"{name} matches several fused patterns {hits}; make them exclusive")
    return hits[0] if hits else None


def _is_expert(name: str, expert_keys: Sequence[str]) -> bool:
    """Whether a module on the parameter's path is named one of ``expert_keys`` (a whole
    name part: ``shared_experts`` is not ``experts``)."""
    return any(part in expert_keys for part in name.split(".")[:-1])


def _one_expert(name: str, expert_keys: Sequence[str]) -> bool:
    """Whether the parameter belongs to one numbered expert module (``experts.3.w1.weight``,
    transformers 4's Mixtral): a matrix of its own, never a fused stack."""
    parts = name.split(".")[:-1]
    return any(a in expert_keys and b.isdigit() for a, b in itertools.pairwise(parts))


def _is_vector_like(name: str, p: torch.Tensor, siblings: Sequence[torch.Tensor]) -> bool:
    """Biases of any shape (``gate_up_proj_bias [E, out]``) and per-expert vectors: a 2-D
    parameter whose rows are the experts of a 3-D stack beside it."""
    leaf = name.split(".")[-1]
    if "bias" in re.split(r"[_\W]+", leaf):
        return True
    return p.ndim == 2 and any(s.ndim == 3 and s.shape[0] == p.shape[0] for s in siblings)


def param_groups(
    model: nn.Module,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    *,
    adamw_betas: tuple[float, float] | None = None,
    adamw_eps: float | None = None,
    expert_keys: Sequence[str] = EXPERT_KEYS,
    num_experts: int | None = None,
    head_patterns: Sequence[str] = (r"(^|\.)(lm_head|output|head|classifier)$",),
    embedding_patterns: Sequence[str] = (r"(^|\.)(embed\w*|wte|wpe|tok_embeddings)$",),
    overrides: Override | None = None,
    fused: Mapping[str, Mapping[str, Any]] | None = None,
    known_layouts: bool = True,
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split a model's parameters into Muon and AdamW groups for :class:`muon_dist.Muon`.

    Hidden matrices go to Muon; embeddings, output heads (tied or not), biases of any shape,
    per-expert vectors and other <2-D parameters go to AdamW. Expert weights are those under
    a module named one of ``expert_keys``: 3-D ones are stacks ``[E, m, n]``, 2-D ones are
    fused ``[E*m, n]`` when ``num_experts`` is given. Groups hold only the options passed
    here (``lr``, ``adamw_lr``, ``weight_decay``, ``adamw_betas``, ``adamw_eps`` and
    ``muon_options`` such as ``muon_mode``); the rest come from :class:`muon_dist.Muon`'s
    arguments. Norms, biases and other vectors always get ``weight_decay=0``; embeddings
    and the head get ``weight_decay`` when it is passed, else ``Muon(adamw_weight_decay=)``.

    ``known_layouts`` applies :mod:`muon_dist.families` (fused gate+up and QKV parts,
    ``[in, out]`` storage) to the families it knows. ``fused`` declares such layouts by name
    regex -> options among ``split_sizes``, ``num_heads``, ``split_groups``, ``transposed``;
    it wins over ``known_layouts``. ``overrides`` moves parameters: a callable
    ``(name, param)`` returning ``"muon"``, ``"adamw"`` or None (keep the default), or a
    mapping of name regexes to ``"muon"``/``"adamw"``. A ``fused`` or ``overrides`` pattern
    that matches no parameter raises. A Muon matrix whose name suggests fusion (``gate_up``,
    ``qkv``, ``w13``, ...) with no layout declared or known logs a warning.
    """
    from muon_dist.families import known_layout, suggests_fusion

    route = _Overrides(overrides)
    fused = dict(fused or {})
    for pattern, spec in fused.items():
        unknown = sorted(set(spec) - set(FUSED_KEYS))
        if unknown or not spec:
            raise ValueError(
                f"fused[{pattern!r}] has keys {sorted(spec)}; use some of {list(FUSED_KEYS)}"
            )
    adamw_ids = _adamw_modules(model, head_patterns, embedding_patterns)
    modules = {normalize_fqn(n): m for n, m in model.named_modules()}
    fused_hits: set[str] = set()
    unsplit: list[str] = []
    buckets: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[str]]] = {}
    seen: set[int] = set()  # a tied parameter is routed once, under its first name
    for module_name, module in model.named_modules():
        siblings = list(module.parameters(recurse=False))
        for leaf, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = normalize_fqn(f"{module_name}.{leaf}" if module_name else leaf)
            key = _route_one(
                name, p, siblings, route, adamw_ids, expert_keys, num_experts, fused, fused_hits
            )
            if key[0] == "muon" and known_layouts and len(key) == 3:
                layout = known_layout(model, name, p, modules)
                if layout is not None:
                    key = (*key, tuple(sorted(layout.items(), key=lambda kv: kv[0])))
                elif suggests_fusion(name):
                    unsplit.append(name)
            params, names = buckets.setdefault(_freeze(key), ([], []))
            params.append(p)
            names.append(name)
    _check_matched(route, fused, fused_hits, buckets)
    if unsplit:
        logger.warning(
            "muon_dist.param_groups: %s look like fused matrices (QKV or gate+up) but no "
            "layout is known or declared, so each is orthogonalized whole; pass "
            "fused={<name regex>: {'split_sizes': [...]}} (plus 'split_groups' for "
            "interleaved parts, 'transposed' for [in, out] storage), or fused={<regex>: "
            "{'split_sizes': [rows]}} to keep one matrix and silence this",
            ", ".join(unsplit),
        )
    given = {"lr": lr, "weight_decay": weight_decay, **muon_options}
    muon = {"algorithm": "muon", **{k: v for k, v in given.items() if v is not None}}
    adamw_given = {"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps}
    adamw = {"algorithm": "adamw", **{k: v for k, v in adamw_given.items() if v is not None}}
    groups = []
    for key, (params, names) in buckets.items():
        group: dict[str, Any] = {"params": params, "param_names": names}
        if key[0] == "muon":
            _, experts, fused_experts, *declared = key
            group.update(muon)
            if experts:
                group["experts"] = True
            if fused_experts is not None:
                group["num_experts"] = fused_experts
            for items in declared:
                group.update({k: list(v) if isinstance(v, tuple) else v for k, v in items})
        else:
            group.update(adamw)
            if key[0] == "adamw_no_decay":
                group["weight_decay"] = 0.0
            elif weight_decay is not None:
                group["weight_decay"] = weight_decay
        groups.append(group)
    groups.sort(key=lambda g: g["algorithm"] != "muon")
    entries = routing_entries(groups)
    logger.info("muon_dist routing:\n%s", format_routing_table(entries))
    return groups


def _freeze(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A hashable group key: list values of a layout become tuples."""
    return tuple(
        tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in part)
        if isinstance(part, tuple) and part and isinstance(part[0], tuple)
        else part
        for part in key
    )


def _route_one(
    name: str,
    p: torch.Tensor,
    siblings: Sequence[torch.Tensor],
    route: _Overrides,
    adamw_ids: set[int],
    expert_keys: Sequence[str],
    num_experts: int | None,
    fused: Mapping[str, Mapping[str, Any]],
    fused_hits: set[str],
) -> tuple[Any, ...]:
    """The group key of one parameter: ``("adamw_decay" | "adamw_no_decay",)``, or
    ``("muon", experts, num_experts[, declared layout])``."""
    forced = route(name, p)
    if forced not in (*ALGORITHMS, None):
        raise ValueError(
            f"overrides returned {forced!r} for {name}; return one of {list(ALGORITHMS)} "
            "or None (default routing)"
        )
    if forced == "muon" and p.ndim < 2:
        raise ValueError(
            f"overrides routed {name} (shape {tuple(p.shape)}) to 'muon', but Muon needs "
            ">= 2-D parameters"
        )
    is_expert = _is_expert(name, expert_keys)
    vector = p.ndim < 2 or _is_vector_like(name, p, siblings if is_expert else ())
    to_muon = forced == "muon" or (forced is None and not vector and id(p) not in adamw_ids)
    if not to_muon:
        return ("adamw_no_decay",) if vector else ("adamw_decay",)
    experts = is_expert and p.ndim == 3
    stacked = is_expert and p.ndim == 2 and not _one_expert(name, expert_keys)
    fused_experts = num_experts if stacked else None
    pattern = _fused_pattern(name, fused)
    if pattern is None:
        return ("muon", experts, fused_experts)
    fused_hits.add(pattern)
    return ("muon", experts, fused_experts, tuple(sorted(fused[pattern].items())))


def _check_matched(
    route: _Overrides,
    fused: Mapping[str, Any],
    fused_hits: set[str],
    buckets: Mapping[tuple[Any, ...], tuple[list[torch.Tensor], list[str]]],
) -> None:
    """Every name pattern the caller gave must have matched a parameter."""
    muon_names = [n for key, (_, names) in buckets.items() if key[0] == "muon" for n in names]
    unmatched = [p for p in fused if p not in fused_hits]
    if unmatched:
        raise ValueError(
            f"fused patterns {unmatched} match no Muon matrix; Muon matrices are {muon_names}"
        )
    if route.unmatched():
        names = [n for _, (_, ns) in buckets.items() for n in ns]
        raise ValueError(
            f"overrides patterns {route.unmatched()} match no parameter (patterns are searched "
            f"in normalised names such as {names[:4]}); fix or remove them"
        )


def group_param_names(group: dict[str, Any], index: int) -> list[str]:
    """Names for error messages and tables: the group's own, else positional ones."""
    return group.get("param_names") or [
        f"group{index}.param{i}" for i in range(len(group["params"]))
    ]


def named_params(groups: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """``(name, group, param)`` for every parameter of ``groups``, in order, named as
    :func:`group_param_names` names them (a saved state's groups hold integer keys)."""
    for index, group in enumerate(groups):
        for name, p in zip(group_param_names(group, index), group["params"], strict=True):
            yield name, group, p


def routing_entries(groups: Sequence[dict[str, Any]]) -> list[RouteEntry]:
    """Routing rows for param groups, one per matrix view, with each view validated."""
    entries = []
    for name, group, p in named_params(groups):
        shape = tuple(p.shape)
        if group.get("algorithm", "muon") != "muon":
            entries.append(RouteEntry(name, shape, "adamw", "-", (), p.numel()))
            continue
        adjust_lr = group.get("adjust_lr", "spectral_norm")
        for view in matrix_views(shape, group, name):
            parts = view.part_split(adjust_lr)
            scales = parts.scales if parts is not None else (view.lr_scale(adjust_lr),)
            entries.append(
                RouteEntry(view.label(name), shape, "muon", view.describe(), scales, view.numel)
            )
    return entries
