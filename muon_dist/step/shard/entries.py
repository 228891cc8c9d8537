"""The Muon views a step is bound to, in plan order, and what this rank holds of each: its
box, the rows of its shard, whether its owned matrices are the primary copies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muon_dist.comm.groups import CommGroups
from muon_dist.plan.build import local_boxes, local_rows, mesh_coords, placement_of
from muon_dist.plan.indices import GroupIndex, TensorIndex
from muon_dist.plan.views import Box, MatrixView
from muon_dist.state.tensors import local


@dataclass(frozen=True)
class MuonEntry:
    """One matrix view of a Muon parameter, in plan order.

    A parameter cut by ``split_sizes`` has one entry per row block; its matrices are
    numbered across its views from ``first_matrix`` on (Magma keeps one score per matrix).
    ``tensor_index`` is the parameter's position among the Muon parameters, ``group_index``
    its group's position among all groups.
    """

    param: torch.Tensor
    group: dict[str, Any]
    view: MatrixView
    name: str
    first_matrix: int
    tensor_index: TensorIndex
    group_index: GroupIndex


def row_matrices(entries: Sequence[MuonEntry], comm: CommGroups) -> torch.Tensor:
    """For each dim-0 row of this rank's shard, which of the parameter's matrices it is in
    (``entries`` are all the views of one parameter)."""
    first = entries[0]
    placement = placement_of(first.param, first.name, first.view, comm.holders.ranks)
    lo, hi = local_rows(placement, comm.rank)
    rows = torch.arange(lo, hi)
    matrices = torch.zeros_like(rows)
    for e in entries:
        start, stop = e.view.box(0, e.view.count)[0]
        inside = (rows >= start) & (rows < stop)
        matrices[inside] = e.first_matrix + (rows[inside] - start) // e.view.dim0_step
    return matrices.to(local(first.param).device)


def primary_owner(entry: MuonEntry, comm: CommGroups, replica_mode: str) -> bool:
    """Whether the matrices of a view this rank owns are their primary copies: always, but
    under ``replica_mode="redundant"``, where each replica has an owner, only in the first
    replica (coordinate 0 on every replicated mesh dim)."""
    if replica_mode != "redundant":
        return True
    placement = placement_of(entry.param, entry.name, entry.view, comm.holders.ranks)
    coord = mesh_coords(placement).get(comm.rank)
    replicated = [d for d, tensor_dim in enumerate(placement.shard_dims) if tensor_dim is None]
    return coord is not None and all(coord[d] == 0 for d in replicated)


def local_box(entry: MuonEntry, comm: CommGroups) -> Box:
    """The box of ``entry``'s view this rank holds."""
    placement = placement_of(entry.param, entry.name, entry.view, comm.holders.ranks)
    return local_boxes(placement)[comm.rank]


@dataclass(frozen=True)
class MuonTensors:
    """The Muon parameters of a plan, numbered as Muon tensors: their views (``entries``,
    in plan order, and each tensor's ``views_of``), parameters, local shards, groups and
    group indices, and the device they are on."""

    entries: tuple[MuonEntry, ...]
    params: tuple[torch.Tensor, ...]
    shards: tuple[torch.Tensor, ...]
    views_of: tuple[tuple[int, ...], ...]
    groups: tuple[dict[str, Any], ...]
    group_of: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, entries: Sequence[MuonEntry]) -> MuonTensors:
        params = list({id(e.param): e.param for e in entries}.values())
        views_of: list[list[int]] = [[] for _ in params]
        for index, e in enumerate(entries):
            views_of[e.tensor_index].append(index)
        shards = tuple(local(p) for p in params)
        return cls(
            tuple(entries),
            tuple(params),
            shards,
            tuple(tuple(views) for views in views_of),
            tuple(entries[views[0]].group for views in views_of),
            tuple(entries[views[0]].group_index for views in views_of),
            shards[0].device,
        )
