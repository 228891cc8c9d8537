"""Collectives on the right ranks: every collective of an optimizer runs among the ranks
that hold its parameters (pipeline stages), and HSDP's redundant all-to-alls among a shard
group only. Each case also checks parity with the single-device reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from parity_cases import Case, P, dense_params, full_value, run_case, set_grads
from torch.distributed.tensor import Replicate, Shard

RECORDED = ("all_to_all_single", "all_reduce", "all_gather_object")


@contextmanager
def recording(calls: list[tuple[str, tuple[int, ...]]]) -> Iterator[None]:
    """Record the global ranks of every collective in ``RECORDED`` issued inside."""
    originals: dict[str, Callable[..., Any]] = {name: getattr(dist, name) for name in RECORDED}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            calls.append((name, tuple(sorted(ranks))))
            return originals[name](*args, group=group, **kwargs)

        return call

    for name in RECORDED:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _stage_params(stage: int) -> list[P]:
    """Different parameters per stage, so collectives issued on the world would not match."""
    if stage == 0:
        return dense_params()
    return [P((40, 24)), P((4, 24, 16), kind="experts"), P((24,), kind="adamw")]


def pipeline_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Two pipeline stages on ranks {0, 1} and {2, 3} (a ("pp", "dp") mesh), each with its
    own FSDP2 model part and its own Muon; fp32 throughout, so parity is exact."""
    stage = rank // 2
    case = Case(
        f"stage{stage}",
        _stage_params(stage),
        (2, world_size // 2),
        fsdp=True,
        mesh_names=("pp", "dp"),
        submesh="dp",
    )
    calls: list[tuple[str, tuple[int, ...]]] = []
    with recording(calls):
        errors = run_case(case, torch.float32, torch.float32, world_size)
    return {"errors": errors, "calls": calls, "stage_ranks": (2 * stage, 2 * stage + 1)}


def hsdp_worker(rank: int, world_size: int, replica_mode: str) -> dict[str, Any]:
    """HSDP on a (replicate 2, shard 2) mesh, fp32 throughout."""
    case = Case(
        f"hsdp_{replica_mode}",
        dense_params(),
        (2, world_size // 2),
        placements=(Replicate(), Shard(0)),
        replica_mode=replica_mode,
    )
    calls: list[tuple[str, tuple[int, ...]]] = []
    with recording(calls):
        errors = run_case(case, torch.float32, torch.float32, world_size)
    shard_group = tuple(r for r in range(world_size) if r // 2 == rank // 2)
    return {"errors": errors, "calls": calls, "shard_group": shard_group}


def _three_steps(
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    fulls: list[torch.Tensor],
    gen: torch.Generator,
    hp: dict[str, Any],
    matrices: list[tuple[int, int, int] | None],
) -> tuple[list[float], list[tuple[str, tuple[int, ...]]]]:
    """Three steps of ``opt`` on fresh gradients against the single-device reference,
    recording the collectives: each parameter's error relative to its reference update."""
    from reference_muon import reference_muon_step

    refs = [f.clone() for f in fulls]
    moms = [torch.zeros_like(f) for f in fulls]
    calls: list[tuple[str, tuple[int, ...]]] = []
    with recording(calls):
        for _ in range(3):
            grads = [torch.randn(f.shape, generator=gen) for f in fulls]
            set_grads(params, grads)
            opt.step()
            for r, g, m, mats in zip(refs, grads, moms, matrices, strict=True):
                reference_muon_step(r, g, m, matrices=mats, ns_dtype=torch.float32, **hp)
    errors = [
        float((full_value(p) - r).abs().max() / (r - f).abs().max())
        for p, r, f in zip(params, refs, fulls, strict=True)
    ]
    return errors, calls


def two_meshes_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A pipeline stage whose parameters live on two meshes over the same ranks (dense
    weights on one, an expert stack on another): the optimizer's group over their ranks is
    created among the stage's ranks only. Three steps against the single-device reference."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import muon_dist

    dense = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))["dp"]
    experts = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "ep"))["ep"]
    stage = rank // 2
    gen = torch.Generator().manual_seed(10 + stage)  # different tensors per stage
    shapes = [(24 + 8 * stage, 16), (4, 12, 8)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    params = [
        nn.Parameter(distribute_tensor(fulls[0].clone(), dense, [Shard(0)])),
        nn.Parameter(distribute_tensor(fulls[1].clone(), experts, [Shard(0)])),
    ]
    hp = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}
    opt = muon_dist.Muon(
        [
            {"params": [params[0]], "algorithm": "muon"},
            {"params": [params[1]], "algorithm": "muon", "experts": True},
        ],
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        **hp,
    )
    errors, calls = _three_steps(opt, params, fulls, gen, hp, [None, (4, 12, 8)])
    return {"errors": errors, "calls": calls, "stage_ranks": (2 * stage, 2 * stage + 1)}


def plain_subgroup_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Plain-tensor replicas (DDP style) per stage, ranks {0, 1} and {2, 3}: with
    ``process_group`` each stage's Muon splits the work among its own ranks only."""
    from torch import nn

    import muon_dist

    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    stage = rank // 2
    gen = torch.Generator().manual_seed(20 + stage)
    shapes = [(24 + 8 * stage, 16), (16, 40), (32, 32)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    params = [nn.Parameter(f.clone()) for f in fulls]
    hp = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}
    opt = muon_dist.Muon(
        [{"params": params, "algorithm": "muon"}],
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        process_group=stages[stage],
        **hp,
    )
    errors, calls = _three_steps(opt, params, fulls, gen, hp, [None] * len(params))
    return {"errors": errors, "calls": calls, "stage_ranks": (2 * stage, 2 * stage + 1)}
