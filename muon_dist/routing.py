"""Which parameters Muon orthogonalizes, and how each one is viewed as a batch of matrices.

Everything here is pure: it reads shapes, names and module types, never tensors' values, so
the same routing comes out on every rank.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Sequence
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
    """A parameter seen as ``count`` matrices of ``rows x cols``.

    Matrix ``i`` covers a rectangular box of the full parameter, so shards can be intersected
    with it without ever materialising the view; a contiguous copy of the box reshapes to
    ``[k, rows, cols]``.
    """

    kind: str  # "matrix" | "expert_stack" | "fused_experts" | "flat" | "slice"
    shape: tuple[int, ...]
    count: int
    rows: int
    cols: int

    def box(self, start: int, stop: int) -> Box:
        """The region of the full parameter covered by matrices ``[start, stop)``."""
        full = tuple((0, s) for s in self.shape)
        if self.kind in ("matrix", "flat"):
            return full
        step = self.rows if self.kind == "fused_experts" else 1
        return ((start * step, stop * step), *full[1:])

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


def matrix_view(
    shape: Sequence[int],
    *,
    muon_mode: str = "2d",
    experts: bool = False,
    num_experts: int | None = None,
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
    muon_mode: str = "2d",
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split a model's parameters into Muon and AdamW groups for :class:`muon_dist.Muon`.

    Hidden matrices go to Muon; embeddings, output heads (tied or not) and <2-D parameters
    go to AdamW. Expert weights are those whose normalised name contains one of
    ``expert_keys``: 3-D ones are stacks ``[E, m, n]``, 2-D ones are fused ``[E*m, n]`` and
    need ``num_experts``. Decay applies to matrices only, never to norms and biases.
    """
    adamw_ids = _adamw_modules(model, head_patterns, embedding_patterns)
    buckets: dict[str, tuple[list[torch.Tensor], list[str]]] = {}
    order = ("muon", "muon_experts", "muon_fused_experts", "adamw_decay", "adamw_no_decay")
    for key in order:
        buckets[key] = ([], [])
    for raw_name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = normalize_fqn(raw_name)
        is_expert = any(k in name for k in expert_keys)
        if p.ndim < 2:
            key = "adamw_no_decay"
        elif id(p) in adamw_ids:
            key = "adamw_decay"
        elif is_expert and p.ndim == 3:
            key = "muon_experts"
        elif is_expert and p.ndim == 2 and num_experts is not None:
            key = "muon_fused_experts"
        else:
            key = "muon"
        buckets[key][0].append(p)
        buckets[key][1].append(name)
    muon = {"algorithm": "muon", "lr": lr, "weight_decay": weight_decay, "muon_mode": muon_mode}
    muon.update(muon_options)
    adamw = {"algorithm": "adamw", "lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps}
    extra: dict[str, dict[str, Any]] = {
        "muon": muon,
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


def routing_entries(groups: Sequence[dict[str, Any]]) -> list[RouteEntry]:
    """Routing rows for param groups, with each Muon matrix view validated."""
    entries = []
    for g_index, group in enumerate(groups):
        names = group_param_names(group, g_index)
        for p, name in zip(group["params"], names, strict=True):
            shape = tuple(p.shape)
            if group.get("algorithm", "muon") == "muon":
                view = matrix_view(
                    shape,
                    muon_mode=group.get("muon_mode", "2d"),
                    experts=group.get("experts", False),
                    num_experts=group.get("num_experts"),
                    name=name,
                )
                entries.append(
                    RouteEntry(
                        name,
                        shape,
                        "muon",
                        view.describe(),
                        view.lr_scale(group.get("adjust_lr", "spectral_norm")),
                        p.numel(),
                    )
                )
            else:
                entries.append(RouteEntry(name, shape, "adamw", "-", 1.0, p.numel()))
    return entries
