"""Which ranks each collective of the optimizer runs on: the smallest group holding its shards.

A collective on the world group would make two optimizers on disjoint ranks (torchtitan
builds one per pipeline stage) issue mismatched collectives, and makes every rank take part
in every bucket's all-to-all. Instead, the ranks come from the parameters' device meshes:

- ``ranks``: every rank holding a shard or replica of any parameter. The agreement on
  gradients, Magma's sums, QK-clip's maxima and the construction check run among them.
- ``exchange_ranks``: the ranks the calling rank's bucket all-to-alls run among. With
  ``replica_mode="redundant"``, each replica of an HSDP mesh orthogonalizes its own copy, so
  a rank only exchanges within its slice of the mesh (its shard group); otherwise ``ranks``.

Groups are taken from the mesh where it has one (a 1-D mesh, one dim of a mesh) and created
among their members only otherwise (``use_local_synchronization``), so ranks outside a group
never have to join its creation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

_CREATED: dict[tuple[int, ...], dist.ProcessGroup] = {}
_DEDICATED: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}  # see dedicated()


@dataclass(frozen=True)
class Peers:
    """A set of global ranks, sorted, and the process group over exactly them (None: the
    default group, when they are the whole world or there is no process group at all)."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """The group rank of a global rank."""
        return self.ranks.index(rank)


@dataclass(frozen=True)
class CommGroups:
    """The groups of one optimizer, as seen by the calling rank."""

    rank: int
    world_size: int
    holders: Peers  # every rank holding any parameter: agreement, Magma, QK-clip, checks
    exchange: Peers  # this rank's bucket all-to-alls


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _group_over(ranks: tuple[int, ...], world_size: int, mesh: DeviceMesh | None) -> Peers:
    """A group over ``ranks``: the default group, a mesh dim's group, or a new one."""
    if ranks == tuple(range(world_size)):
        return Peers(ranks, None)
    if mesh is not None:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if tuple(sorted(dist.get_process_group_ranks(group))) == ranks:
                return Peers(ranks, group)
    if ranks not in _CREATED:
        _CREATED[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return Peers(ranks, _CREATED[ranks])


def _mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _slice_ranks(mesh: DeviceMesh, fixed_dims: Sequence[int], rank: int) -> tuple[int, ...]:
    """Ranks of ``mesh`` that share ``rank``'s coordinates on ``fixed_dims``."""
    grid = mesh.mesh
    coords = dict(
        zip(
            (int(r) for r in grid.flatten().tolist()),
            itertools.product(*(range(s) for s in grid.shape)),
            strict=True,
        )
    )
    mine = coords[rank]
    return tuple(sorted(r for r, c in coords.items() if all(c[d] == mine[d] for d in fixed_dims)))


def comm_groups(
    params: Sequence[torch.Tensor],
    replica_mode: str,
    process_group: dist.ProcessGroup | None = None,
) -> CommGroups:
    """The groups for an optimizer over ``params``.

    Plain tensors count as replicated on every rank of ``process_group`` (default: the
    world); pass it when plain-tensor replicas live on a subset of ranks (DDP on a subgroup).
    """
    rank, world_size = _distributed()
    if world_size == 1:
        solo = Peers((0,), None)
        return CommGroups(0, 1, solo, solo)
    if process_group is not None:
        base = tuple(sorted(dist.get_process_group_ranks(process_group)))
        plain = Peers(base, None if base == tuple(range(world_size)) else process_group)
    else:
        plain = Peers(tuple(range(world_size)), None)
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if len(dtensors) < len(params) or not dtensors:
        return CommGroups(rank, world_size, plain, plain)
    meshes = {id(p.device_mesh): p.device_mesh for p in dtensors}
    held = tuple(sorted({r for mesh in meshes.values() for r in _mesh_ranks(mesh)}))
    one_mesh = next(iter(meshes.values())) if len(meshes) == 1 else None
    holders = _group_over(held, world_size, one_mesh)
    if replica_mode != "redundant" or one_mesh is None:
        return CommGroups(rank, world_size, holders, holders)
    # Each replica orthogonalizes its own copy: exchanges stay among the ranks that share
    # this rank's coordinates on the dims every parameter replicates over.
    replicated = [
        d
        for d in range(one_mesh.ndim)
        if all(isinstance(p.placements[d], Replicate) for p in dtensors)
    ]
    if not replicated:
        return CommGroups(rank, world_size, holders, holders)
    ranks = _slice_ranks(one_mesh, replicated, rank)
    return CommGroups(rank, world_size, holders, _group_over(ranks, world_size, one_mesh))


def dedicated(peers: Peers, use: str = "exchange") -> Peers:
    """A new process group over ``peers``' ranks, for collectives that run while another
    user of their group (FSDP's reduce-scatters during backward, the buckets' all-to-alls)
    has its own in flight: on their own communicator, neither queues behind the other. One
    group per ``use``; every rank among ``peers`` must call this, in the same order; the
    optimizers of a process share one such group per use."""
    if peers.size == 1:
        return peers
    key = (peers.ranks, use)
    if key not in _DEDICATED:
        _DEDICATED[key] = dist.new_group(list(peers.ranks), use_local_synchronization=True)
    return Peers(peers.ranks, _DEDICATED[key])
