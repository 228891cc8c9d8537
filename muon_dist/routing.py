"""Which parameters Muon orthogonalizes, and how each one is viewed as a batch of matrices.

Everything here is pure: it reads shapes, names and module types, never tensors' values, so
the same routing comes out on every rank.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
class MatrixView:
    """A parameter, or a block of its rows, seen as ``count`` matrices of ``rows x cols``.

    Matrix ``i`` covers a rectangular box of the full parameter, so shards can be intersected
    with it without ever materialising the view; a contiguous copy of the box reshapes to
    ``[k, rows, cols]``. A parameter cut by ``split_sizes`` has one view per row block, each
    starting at its ``row_offset``.
    """

    kind: str  # "matrix" | "heads" | "expert_stack" | "fused_experts" | "flat" | "slice"
    shape: tuple[int, ...]
    count: int
    rows: int
    cols: int
    row_offset: int = 0

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

    def lr_scale(self, adjust_lr: str | None) -> float:
        """Learning-rate multiplier from the full per-matrix shape, never a shard's."""
        if adjust_lr == "spectral_norm":
            return math.sqrt(max(1.0, self.rows / self.cols))
        if adjust_lr == "rms_norm":
            return 0.2 * math.sqrt(max(self.rows, self.cols))
        return 1.0

    def describe(self) -> str:
        if self.count == 1:
            return f"{self.kind} {self.rows}x{self.cols}"
        return f"{self.kind} {self.count}x[{self.rows}x{self.cols}]"


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def matrix_view(
    shape: Sequence[int],
    *,
    muon_mode: str = "2d",
    experts: bool = False,
    num_experts: int | None = None,
    num_heads: int | None = None,
    name: str = "parameter",
) -> MatrixView:
    """Decide how a Muon parameter of ``shape`` splits into matrices, or explain why it can't."""
    shape = tuple(int(s) for s in shape)
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

    One view, except with ``split_sizes`` (a fused weight such as QKV or gate+up): then one
    view per row block, each cut into ``num_heads[i]`` heads when ``num_heads`` is a list.
    """
    split = group.get("split_sizes")
    heads = group.get("num_heads")
    if split is None:
        return [
            matrix_view(
                shape,
                muon_mode=group.get("muon_mode", "2d"),
                experts=group.get("experts", False),
                num_experts=group.get("num_experts"),
                num_heads=heads,
                name=name,
            )
        ]
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or group.get("num_experts") is not None:
        raise ValueError(
            f"{name} has shape {shape} and num_experts={group.get('num_experts')}, but "
            f"split_sizes={split!r} cuts the rows of a plain 2-D weight; use it without "
            "num_experts, on a 2-D parameter"
        )
    valid = isinstance(split, (list, tuple)) and all(is_positive_int(s) for s in split)
    if not valid or sum(split) != shape[0]:
        raise ValueError(
            f"{name} has {shape[0]} rows but its group sets split_sizes={split!r}; "
            "split_sizes must be positive row counts adding up to the rows, "
            "e.g. [q_rows, k_rows, v_rows]"
        )
    if heads is None:
        heads = [1] * len(split)
    elif not isinstance(heads, (list, tuple)) or len(heads) != len(split):
        raise ValueError(
            f"{name}: split_sizes={list(split)} takes num_heads=None or a list of one head "
            f"count per block (e.g. [q_heads, kv_heads, kv_heads]), not num_heads={heads!r}"
        )
    views, offset = [], 0
    for i, (size, count) in enumerate(zip(split, heads, strict=True)):
        if not is_positive_int(count) or size % count:
            raise ValueError(
                f"{name}: block {i} of split_sizes={list(split)} has {size} rows, not "
                f"divisible by num_heads[{i}]={count!r}"
            )
        kind = "heads" if count > 1 else "matrix"
        views.append(MatrixView(kind, shape, count, size // count, shape[1], offset))
        offset += size
    return views


@dataclass(frozen=True)
class RouteEntry:
    """One row of the routing table."""

    name: str
    shape: tuple[int, ...]
    algorithm: str
    view: str
    lr_scale: float
    numel: int


def format_routing_table(entries: Iterable[RouteEntry]) -> str:
    """Render routing rows as an aligned text table with per-algorithm totals in millions."""
    rows = [("name", "shape", "algorithm", "matrix view", "lr scale", "params (M)")]
    totals: dict[str, int] = {}
    for e in entries:
        shape = "x".join(str(s) for s in e.shape) or "scalar"
        scale = f"{e.lr_scale:.3f}" if e.algorithm == "muon" else "-"
        rows.append((e.name, shape, e.algorithm, e.view, scale, f"{e.numel / 1e6:.2f}"))
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

FUSED_KEYS = ("split_sizes", "num_heads")


def _override_fn(overrides: Override | None) -> Callable[[str, torch.Tensor], str | None]:
    """One callable for both override forms; a mapping's first matching pattern wins."""
    if overrides is None:
        return lambda _name, _p: None
    if callable(overrides):
        return overrides
    patterns = dict(overrides)
    for pattern, algorithm in patterns.items():
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"overrides[{pattern!r}]={algorithm!r}; choose one of {list(ALGORITHMS)}"
            )
    return lambda name, _p: next((a for p, a in patterns.items() if re.search(p, name)), None)


def _fused_pattern(name: str, fused: Mapping[str, Mapping[str, Any]]) -> str | None:
    hits = [pattern for pattern in fused if re.search(pattern, name)]
    if len(hits) > 1:
        raise ValueError(f"{name} matches several fused patterns {hits}; make them exclusive")
    return hits[0] if hits else None


def param_groups(
    model: nn.Module,
    lr: float = 0.02,
    adamw_lr: float = 3e-4,
    weight_decay: float = 0.1,
    *,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    expert_keys: Sequence[str] = ("experts",),
    num_experts: int | None = None,
    head_patterns: Sequence[str] = (r"(^|\.)(lm_head|output|head|classifier)$",),
    embedding_patterns: Sequence[str] = (r"(^|\.)(embed\w*|wte|wpe|tok_embeddings)$",),
    overrides: Override | None = None,
    fused: Mapping[str, Mapping[str, Any]] | None = None,
    muon_mode: str = "2d",
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split a model's parameters into Muon and AdamW groups for :class:`muon_dist.Muon`.

    Hidden matrices go to Muon; embeddings, output heads (tied or not) and <2-D parameters
    go to AdamW. Expert weights are those whose normalised name contains one of
    ``expert_keys``: 3-D ones are stacks ``[E, m, n]``, 2-D ones are fused ``[E*m, n]`` and
    need ``num_experts``. Decay applies to matrices only, never to norms and biases.

    ``overrides`` moves parameters by name: a callable ``(name, param)`` returning
    ``"muon"``, ``"adamw"`` or None (keep the default), or a mapping of name regexes to
    ``"muon"``/``"adamw"``. ``fused`` declares how Muon matrices are cut into row blocks:
    name regex -> ``{"split_sizes": [...], "num_heads": ...}``; each pattern gets a group.
    """
    route = _override_fn(overrides)
    fused = dict(fused or {})
    for pattern, spec in fused.items():
        unknown = sorted(set(spec) - set(FUSED_KEYS))
        if unknown or not spec:
            raise ValueError(
                f"fused[{pattern!r}] has keys {sorted(spec)}; use one or both of {list(FUSED_KEYS)}"
            )
    adamw_ids = _adamw_modules(model, head_patterns, embedding_patterns)
    order = [
        "muon",
        *(f"fused:{p}" for p in fused),
        "muon_experts",
        "muon_fused_experts",
        "adamw_decay",
        "adamw_no_decay",
    ]
    buckets: dict[str, tuple[list[torch.Tensor], list[str]]] = {key: ([], []) for key in order}
    for raw_name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = normalize_fqn(raw_name)
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
        to_muon = forced == "muon" or (forced is None and p.ndim >= 2 and id(p) not in adamw_ids)
        is_expert = any(k in name for k in expert_keys)
        if not to_muon:
            key = "adamw_decay" if p.ndim >= 2 else "adamw_no_decay"
        elif is_expert and p.ndim == 3:
            key = "muon_experts"
        elif is_expert and p.ndim == 2 and num_experts is not None:
            key = "muon_fused_experts"
        else:
            hit = _fused_pattern(name, fused)
            key = "muon" if hit is None else f"fused:{hit}"
        buckets[key][0].append(p)
        buckets[key][1].append(name)
    unmatched = [p for p in fused if not buckets[f"fused:{p}"][0]]
    if unmatched:
        raise ValueError(
            f"fused patterns {unmatched} match no Muon matrix outside expert groups; "
            f"Muon matrices are {buckets['muon'][1]}"
        )
    muon = {"algorithm": "muon", "lr": lr, "weight_decay": weight_decay, "muon_mode": muon_mode}
    muon.update(muon_options)
    adamw = {"algorithm": "adamw", "lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps}
    extra: dict[str, dict[str, Any]] = {
        "muon": muon,
        **{f"fused:{p}": {**muon, **spec} for p, spec in fused.items()},
        "muon_experts": {**muon, "experts": True},
        "muon_fused_experts": {**muon, "num_experts": num_experts},
        "adamw_decay": {**adamw, "weight_decay": weight_decay},
        "adamw_no_decay": {**adamw, "weight_decay": 0.0},
    }
    groups = [
        {"params": params, "param_names": names, **extra[key]}
        for key, (params, names) in buckets.items()
        if params
    ]
    entries = routing_entries(groups)
    logger.info("muon_dist routing:\n%s", format_routing_table(entries))
    return groups


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
            entries.append(RouteEntry(name, shape, "adamw", "-", 1.0, p.numel()))
            continue
        adjust_lr = group.get("adjust_lr", "spectral_norm")
        entries += [
            RouteEntry(
                view.label(name),
                shape,
                "muon",
                view.describe(),
                view.lr_scale(adjust_lr),
                view.numel,
            )
            for view in matrix_views(shape, group, name)
        ]
    return entries
