"""Rank agreement on everything that decides a step, checked where the host changes it.

Every rank must run the same step: the same execution settings, the same group options and
the same parameters, in the same order, with the same names, shapes, dtypes and placements.
:func:`describe` writes all of it as ``key -> value`` text; :func:`agree` compares the
descriptions of all ranks with one all-gather of a digest and each rank's refusal (the
error its own checks raised, or None), so a refusal on one rank reaches the others through
the check itself, never through a timeout. Only when something differs is a second
all-gather made, of the whole descriptions, to name the keys, the ranks and their values.
The constructor, ``add_param_group`` and ``load_state_dict`` call it; the values a
scheduler changes between steps are agreed inside the step (:mod:`muon_dist.step.agree.agreement`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon_dist.comm.groups import CommGroups, Peers, comm_groups, dedicated
from muon_dist.plan.views import named_params, param_list

# Differing keys named in an error, at most.
_SHOWN = 3


class Settings(Protocol):
    """What agreement reads of the execution settings (a dataclass: every field is agreed;
    :class:`muon_dist.options.settings.ExecutionSettings` is one), so this layer does not
    depend on the options layer."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def replica_mode(self) -> str: ...

    @property
    def starts_in_backward(self) -> bool: ...


def describe(
    groups: Sequence[dict[str, Any]],
    settings: Settings,
    extra: Sequence[str] = (),
) -> dict[str, str]:
    """Everything that decides a step, as text: the settings, each group's options, each
    parameter by position (name, shape, dtype, placements, mesh) and ``extra`` lines.

    A plain tensor (a replica on every rank) also shows a fingerprint of its values:
    replicas must start equal, and same-shape parameters listed in another order on another
    rank (a reordered list without names) differ there.
    """
    entries = {f"setting {f.name}": repr(getattr(settings, f.name)) for f in fields(settings)}
    for index, group in enumerate(groups):
        for key in sorted(group):
            if key not in ("params", "param_names"):
                entries[f"param group {index} {key}"] = repr(group[key])
    named = list(named_params(groups))
    prints = _fingerprints([p for _, _, p in named if not isinstance(p, DTensor)])
    for position, (name, _, p) in enumerate(named):
        if isinstance(p, DTensor):
            where = f"{tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)}"
        else:
            where = f"plain values {prints.pop(0)}"
        entries[f"parameter {position}"] = f"{name!r} {tuple(p.shape)} {p.dtype} {where}"
    for index, line in enumerate(extra):
        entries[f"extra {index}"] = line
    return entries


def _fingerprints(tensors: list[torch.Tensor]) -> list[str]:
    """Per tensor, its sum and 2-norm in fp64 (no fp64 copy of it), read with one host
    copy: equal on replicas, different for other values."""
    if not tensors:
        return []
    with torch.no_grad():
        sums = [torch.sum(t, dtype=torch.float64) for t in tensors]
        norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float64)
        vectors = [torch.stack([a, b]) for a, b in zip(sums, norms, strict=True)]
        if len({v.device for v in vectors}) == 1:
            pairs = torch.stack(vectors).tolist()
        else:
            pairs = [v.tolist() for v in vectors]
    return [f"{a:.17g}/{b:.17g}" for a, b in pairs]


def agree(
    entries: dict[str, str],
    refusal: Exception | None,
    rank: int,
    holders: Peers,
    when: str,
) -> None:
    """Raise on every rank unless all ``holders`` have the same ``entries`` and none refused.

    A refusing rank raises its own ``refusal``; the others raise ``RuntimeError`` quoting
    it. Otherwise, when entries differ, every rank raises ``RuntimeError`` naming the first
    differing keys, which ranks hold which value, and ``when`` (the call that was checked).
    """
    if holders.size == 1:
        if refusal is not None:
            raise refusal
        return
    digest = hashlib.sha256(repr(sorted(entries.items())).encode()).hexdigest()
    mine = (digest, None if refusal is None else f"{type(refusal).__name__}: {refusal}")
    gathered: list[tuple[str, str | None] | None] = [None] * holders.size
    dist.all_gather_object(gathered, mine, group=holders.group)
    if refusal is not None:
        raise refusal
    refused = [(r, g[1]) for r, g in zip(holders.ranks, gathered, strict=True) if g and g[1]]
    if refused:
        quoted = "; ".join(f"rank {r}: {message}" for r, message in refused)
        raise RuntimeError(
            f"muon_dist.Muon {when}: refused on another rank (this is rank {rank}), so "
            f"nothing changed on any rank; {quoted}"
        )
    if len({g[0] for g in gathered if g}) == 1:
        return
    every: list[dict[str, str] | None] = [None] * holders.size
    dist.all_gather_object(every, entries, group=holders.group)
    raise RuntimeError(_difference(every, holders.ranks, rank, when))


def _difference(
    every: Sequence[dict[str, str] | None], ranks: Sequence[int], rank: int, when: str
) -> str:
    """The message naming the first keys whose values differ across ranks."""
    keys: dict[str, None] = {}
    for entries in every:
        keys.update(dict.fromkeys(entries or {}))
    lines = []
    for key in keys:
        holders_of: dict[str, list[int]] = {}
        for r, entries in zip(ranks, every, strict=True):
            holders_of.setdefault((entries or {}).get(key, "<absent>"), []).append(r)
        if len(holders_of) > 1:
            values = "; ".join(f"ranks {rs}: {value}" for value, rs in holders_of.items())
            lines.append(f"{key}: {values}")
    shown = "\n  ".join(lines[:_SHOWN])
    more = f"\n  (and {len(lines) - _SHOWN} more)" if len(lines) > _SHOWN else ""
    return (
        f"muon_dist.Muon {when}: the ranks disagree on what decides the step (this is rank "
        f"{rank}), so nothing changed on any rank:\n  {shown}{more}\nEvery rank that holds "
        "these parameters must pass the same settings, options and parameters, in the same "
        "order, with the same names (list parameters in a fixed order, e.g. "
        "model.named_parameters(), never a set), and replicas must hold the same values "
        "(broadcast them first)."
    )


def agreed_comm(
    groups: Sequence[dict[str, Any]],
    refused: Exception | None,
    when: str,
    settings: Settings | None,
    process_group: dist.ProcessGroup | None,
    extra: Sequence[str],
) -> CommGroups:
    """The collectives' groups for ``groups`` (:func:`muon_dist.comm.groups.comm_groups`),
    after every rank that holds them agreed on them and on ``extra``; raises on every rank
    otherwise (a rank's own ``refused`` reaches the others through the same check, and
    ``settings`` is None where they were refused)."""
    params = [p for g in groups for p in param_list(g.get("params", []))]
    comm = comm_groups(
        [p for p in params if isinstance(p, torch.Tensor)],
        "split" if refused or settings is None else settings.replica_mode,
        process_group,
    )
    entries = {} if refused or settings is None else describe(groups, settings, extra)
    agree(entries, refused, comm.rank, comm.holders, when)
    if settings is not None and settings.starts_in_backward:
        # Exchanges issued during backward run beside FSDP's, not behind them.
        comm = dataclasses.replace(comm, exchange=dedicated(comm.exchange))
    return comm
