"""The routing table: one row per matrix view of every parameter of param groups."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from muon_dist.plan.views import matrix_views, named_params


@dataclass(frozen=True)
class RouteEntry:
    """One row of the routing table; ``lr_scales`` has one entry per part of the view."""

    name: str
    shape: tuple[int, ...]
    algorithm: str
    view: str
    lr_scales: tuple[float, ...]
    numel: int
    reason: str = ""

    @property
    def scale_text(self) -> str:
        return "/".join(f"{s:.3f}" for s in self.lr_scales) if self.algorithm == "muon" else "-"


def format_routing_table(entries: Iterable[RouteEntry]) -> str:
    """Render routing rows as an aligned text table with per-algorithm totals in millions;
    a reason column where the rows carry reasons (param_groups' audit)."""
    entries = list(entries)
    reasons = any(e.reason for e in entries)
    header = ("name", "shape", "algorithm", "matrix view", "lr scale", "params (M)")
    rows: list[tuple[str, ...]] = [header + (("reason",) if reasons else ())]
    totals: dict[str, int] = {}
    for e in entries:
        shape = "x".join(str(s) for s in e.shape) or "scalar"
        row = (e.name, shape, e.algorithm, e.view, e.scale_text, f"{e.numel / 1e6:.2f}")
        rows.append(row + ((e.reason,) if reasons else ()))
        totals[e.algorithm] = totals.get(e.algorithm, 0) + e.numel
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    summary = ", ".join(f"{alg}: {n / 1e6:.2f}M" for alg, n in sorted(totals.items()))
    lines.append(f"total {summary}")
    return "\n".join(lines)


def routing_entries(
    groups: Sequence[dict[str, Any]], reasons: Mapping[str, str] | None = None
) -> list[RouteEntry]:
    """Routing rows for param groups, one per matrix view, with each view validated;
    ``reasons`` (by parameter name) fills the reason column."""
    reasons = reasons or {}
    entries = []
    for name, group, p in named_params(groups):
        shape = tuple(p.shape)
        why = reasons.get(name, "")
        if group.get("algorithm", "muon") != "muon":
            entries.append(RouteEntry(name, shape, "adamw", "-", (), p.numel(), why))
            continue
        adjust_lr = group.get("adjust_lr", "spectral_norm")
        for view in matrix_views(shape, group, name):
            parts = view.part_split(adjust_lr)
            scales = parts.scales if parts is not None else (view.lr_scale(adjust_lr),)
            entries.append(
                RouteEntry(
                    view.label(name), shape, "muon", view.describe(), scales, view.numel, why
                )
            )
    return entries
