"""Layouts the distributed step must support, each run against the single-device reference.

Every rank builds the same full tensors from a fixed seed, shards them with the layout
under test, takes three optimizer steps, and compares the gathered result with
``reference_muon_step`` / ``torch.optim.AdamW`` on the full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from reference_muon import reference_muon_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import muon_dist

STEPS = 3

# A case's precision: (communication dtype, Newton–Schulz dtype). "mixed" keeps the path that
# casts between the two dtypes covered; only "fp32" is compared exactly.
PRECISIONS = {
    "fp32": ("float32", "float32"),
    "bf16": ("bfloat16", "bfloat16"),
    "mixed": ("float32", "bfloat16"),
}

# fp32 end to end (fp32 communication and Newton–Schulz): the sharded step and the reference
# differ only by fp32 summation order, which Newton–Schulz amplifies to at most 3.2e-6 of the
# update, norm-wise (measured against the reference's float64 sums, reordered_products.py).
EXACT = 1e-5

# Newton–Schulz in bf16, compared within bf16 rounding. bf16 keeps 8 significant bits: unit
# roundoff u = 2^-8 ≈ 3.9e-3, and two correct kernels that sum a product in different orders
# may round it one ulp apart (up to 2u of an entry). Each step's differences pass through the
# remaining steps, which amplify them along small singular values (the polynomial's slope a:
# 3.4 for the quintic, 8.2 in Polar Express's first step) and damp them near 1, so the final
# difference is a small multiple of u. The error is relative to each parameter's update:
# lr·scale multiplies the update and its error alike and cancels, and three steps add both.
# Measured worst, norm-wise: 3.0e-3 (0.77u: shard1, tp_fsdp) against the reference's float64
# sums on CPU; issue 23 saw 3.1e-4 to 1.4e-3 (largest element) on Intel AMX. 2.5u = 1e-2
# leaves 3x headroom, and any defect that moves more than 1% of an update (norm-wise) fails
# it: test_parity_mutations shows a wrong shard offset, lr scale, transposed or dropped piece do.
BF16_UPDATE = 1e-2


# The bf16 input of Newton–Schulz can also differ by one rounding: two correct fp32 forms of
# the momentum (a fused multiply-add, or a multiply then an add) may differ in the last bit,
# which now and then moves an entry to the other bf16 neighbour. Newton–Schulz amplifies
# such a flip by how far the schedule stretches small singular values: per group, the worst
# norm-wise change of one matrix's update from one flipped entry, over every entry of every
# step of the ep_fsdp case's matrices (bf16_flips.py measures it; test_parity_bounds
# checks these cover it). Polar Express's first step (slope 8.2) makes its flips 7x the
# quintic's: on 4 H200s its 10×12 experts came out 1.96e-2 from the reference (two flips).
BF16_FLIP = {"a": 2e-3, "b": 1.1e-2, "gram": 1.5e-3}


def bf16_scale(group: str) -> float:
    """A group's bf16 bound relative to ``BF16_UPDATE``: the kernels' own rounding plus two
    input flips over a run."""
    return (BF16_UPDATE + 2 * BF16_FLIP[group]) / BF16_UPDATE


# A bf16 parameter rounds at each decay, momentum and update: its update is mostly rounding,
# so it is compared with the parameter: a few ulps of 2^-8 (mutations use fp32 parameters).
BF16_PARAM = 3e-2


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Give each parameter its full gradient, placed like the parameter. Every rank holds
    the same gradients (one seed), so each cuts its own piece: distribute_tensor's default
    scatter from rank 0 would add a collective per parameter and step, seconds over the
    parity suite on 2 cores. A copy, as the scatter's output is, never a view of ``g``."""
    for p, g in zip(params, grads, strict=True):
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None).clone()
        else:
            p.grad = g.clone()


def full_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, gathered from its shards if it is a DTensor."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


@dataclass
class P:
    """One parameter of a case: its full shape, routing and placements."""

    shape: tuple[int, ...]
    kind: str = "matrix"  # "matrix" | "experts" | "fused" | "adamw"
    placements: tuple[Placement, ...] | None = None  # None: the case's default
    dtype: torch.dtype = torch.float32
    group: str = "a"  # muon hyper-parameter set


@dataclass
class Case:
    name: str
    params: list[P]
    mesh_shape: tuple[int, ...] | None  # None: plain tensors, no DTensor
    placements: tuple[Placement, ...] = (Shard(0),)
    fsdp: bool = False  # shard with fully_shard instead of distribute_tensor
    replica_mode: str = "split"
    extra: dict[str, Any] = field(default_factory=dict)
    mesh_names: tuple[str, ...] | None = None
    submesh: str | None = None  # shard over this named dim of the mesh only


MUON_SETS: dict[str, dict[str, Any]] = {
    "a": {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1},
    "b": {
        "lr": 0.05,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 0.0,
        "adjust_lr": "rms_norm",
        "coefficients": "polar_express",
    },
    "gram": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_method": "gram"},
}
FUSED_EXPERTS = 4
DION2_FRACTION = 0.25  # the optimizer's default, which the runs under Dion2 keep


def _groups(case: Case, tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for i, (spec, t) in enumerate(zip(case.params, tensors, strict=True)):
        if spec.kind == "adamw":
            key = ("adamw", "")
            base: dict[str, Any] = {"algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.01}
        else:
            key = (spec.kind, spec.group)
            base = {"algorithm": "muon", **MUON_SETS[spec.group]}
            if spec.kind == "experts":
                base["experts"] = True
            if spec.kind == "fused":
                base["num_experts"] = FUSED_EXPERTS
        group = groups.setdefault(key, {**base, "params": [], "param_names": []})
        group["params"].append(t)
        group["param_names"].append(f"{case.name}.p{i}.{spec.kind}")
    return list(groups.values())


def _reference(
    ns_dtype: torch.dtype,
    case: Case,
    fulls: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    rule: str = "muon",
) -> list[torch.Tensor]:
    params = [f.clone() for f in fulls]
    moms = [torch.zeros_like(f) for f in fulls]
    # NorMuon's second moment: one entry per row of each matrix (the reference's rows).
    row_moments = [torch.zeros(f.numel() // f.shape[-1]) for f in fulls]
    adamw_params = [
        nn.Parameter(p) for p, s in zip(params, case.params, strict=True) if s.kind == "adamw"
    ]
    adamw = (
        torch.optim.AdamW(adamw_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        if adamw_params
        else None
    )
    for step_grads in grads:
        for p, g, m, v, spec in zip(
            params, step_grads, moms, row_moments, case.params, strict=True
        ):
            if spec.kind == "adamw":
                continue
            hp = dict(MUON_SETS[spec.group])
            matrices = None
            if spec.kind == "experts":
                matrices = (p.shape[0], p.shape[1], p.shape[2])
            elif spec.kind == "fused":
                matrices = (FUSED_EXPERTS, p.shape[0] // FUSED_EXPERTS, p.shape[1])
            moment = v if rule == "normuon" else None
            fraction = DION2_FRACTION if rule == "dion2" else None
            reference_muon_step(
                p,
                g,
                m,
                matrices=matrices,
                ns_dtype=ns_dtype,
                row_moment=moment,
                dion2_fraction=fraction,
                **hp,
            )
        if adamw is not None:
            for ap, g in zip(
                adamw_params,
                [g for g, s in zip(step_grads, case.params, strict=True) if s.kind == "adamw"],
                strict=True,
            ):
                ap.grad = g
            adamw.step()
    return [p.detach() for p in params]


def _shard(
    case: Case, fulls: list[torch.Tensor], world_size: int, device: str
) -> tuple[list[torch.Tensor], Any]:
    if case.mesh_shape is None:
        return [nn.Parameter(f.clone()) for f in fulls], None
    mesh = init_device_mesh(device, case.mesh_shape, mesh_dim_names=case.mesh_names)
    if case.submesh is not None:
        mesh = mesh[case.submesh]
    if case.fsdp:
        module = nn.Module()
        for i, f in enumerate(fulls):
            module.register_parameter(f"p{i}", nn.Parameter(f.clone()))
        fully_shard(module, mesh=mesh)
        return [getattr(module, f"p{i}") for i in range(len(fulls))], mesh
    params = []
    for f, spec in zip(fulls, case.params, strict=True):
        placements = spec.placements or case.placements
        params.append(nn.Parameter(distribute_tensor(f.clone(), mesh, list(placements))))
    return params, mesh


@dataclass
class Trained:
    """A case's sharded run: its full starting tensors and gradients, and where they led."""

    fulls: list[torch.Tensor]
    grads: list[list[torch.Tensor]]
    params: list[torch.Tensor]
    opt: muon_dist.Muon


def train_case(
    case: Case,
    comm_dtype: torch.dtype,
    ns_dtype: torch.dtype,
    world_size: int,
    device: str = "cpu",
    rule: str = "muon",
) -> Trained:
    """``STEPS`` sharded steps of ``case`` from the fixed seed's tensors and gradients."""
    gen = torch.Generator().manual_seed(1234)
    fulls = [torch.randn(s.shape, generator=gen).to(device, s.dtype) for s in case.params]
    grads = [
        [torch.randn(s.shape, generator=gen).to(device, s.dtype) for s in case.params]
        for _ in range(STEPS)
    ]
    params, _ = _shard(case, fulls, world_size, device)
    opt = muon_dist.Muon(
        _groups(case, params),
        comm_dtype=comm_dtype,
        ns_dtype=ns_dtype,
        replica_mode=case.replica_mode,
        rule=rule,
        **case.extra,
    )
    for step_grads in grads:
        set_grads(params, step_grads)
        opt.step()
    return Trained(fulls, grads, params, opt)


def run_case(
    case: Case,
    comm_dtype: torch.dtype,
    ns_dtype: torch.dtype,
    world_size: int,
    device: str = "cpu",
    rule: str = "muon",
) -> dict[str, float]:
    trained = train_case(case, comm_dtype, ns_dtype, world_size, device, rule)
    fulls, grads, params = trained.fulls, trained.grads, trained.params
    expected = _reference(ns_dtype, case, fulls, grads, rule)
    # fp32 parameters: max error relative to the update ("update") and to the parameter
    # ("param"), and the norm-wise relative error of the update ("update_fro"; under bf16
    # Newton–Schulz in units of the group's bound, bf16_scale); bf16 parameters: relative to
    # the parameter, since their decay and update round to bf16.
    errors = {"update": 0.0, "param": 0.0, "update_fro": 0.0, "bf16_param": 0.0}
    for p, ref, full, spec in zip(params, expected, fulls, case.params, strict=True):
        got = full_value(p).float()
        diff = got - ref.float()
        worst = diff.abs().max().item()
        if ref.dtype == torch.bfloat16:
            errors["bf16_param"] = max(errors["bf16_param"], worst / ref.float().abs().max().item())
            continue
        update = ref - full
        errors["update"] = max(errors["update"], worst / max(update.abs().max().item(), 1e-30))
        errors["param"] = max(errors["param"], worst / ref.abs().max().item())
        fro = (diff.norm() / update.norm().clamp_min(1e-30)).item()
        if ns_dtype == torch.bfloat16:
            fro /= bf16_scale(spec.group)
        errors["update_fro"] = max(errors["update_fro"], fro)
    if case.mesh_shape is None and world_size > 1:
        _assert_replicas_identical(params)
    return errors


def _assert_replicas_identical(params: list[torch.Tensor]) -> None:
    for p in params:
        gathered = [torch.empty_like(p.detach()) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach().contiguous())
        for other in gathered:
            assert torch.equal(other, p.detach()), "replicated parameters diverged across ranks"


def dense_params() -> list[P]:
    return [
        P((3, 40)),
        P((130, 7)),
        P((64, 48), group="b"),
        P((48, 64)),
        P((32, 24), dtype=torch.bfloat16),
        P((4, 24, 16), kind="experts"),
        P((FUSED_EXPERTS * 12, 20), kind="fused"),
        P((64,), kind="adamw"),
        P((50, 16), kind="adamw"),
        *gram_params(),
    ]


def gram_params() -> list[P]:
    """Wide, tall and expert matrices in a group with ``ns_method="gram"``."""
    return [
        P((24, 72), group="gram"),
        P((90, 20), group="gram"),
        P((3, 12, 40), kind="experts", group="gram"),
    ]


def cases_for(world_size: int) -> list[Case]:
    cases = [
        Case("fsdp", dense_params(), (world_size,), fsdp=True),
        # nonfinite="skip_step" computes every update before committing any of them.
        Case(
            "fsdp_skip_mode",
            dense_params(),
            (world_size,),
            fsdp=True,
            extra={"nonfinite": "skip_step"},
        ),
        Case("shard1", dense_params()[:5] + gram_params(), (world_size,), placements=(Shard(1),)),
        Case("replicated", dense_params(), None),
    ]
    if world_size % 2 == 0:
        two_d = (2, world_size // 2)
        stacks = [
            P((4, 24, 16), kind="experts"),
            P((6, 10, 12), kind="experts", group="b"),
            P((4, 10, 30), kind="experts", group="gram"),
        ]
        cases += [
            Case("hsdp_split", dense_params(), two_d, placements=(Replicate(), Shard(0))),
            Case(
                "hsdp_redundant",
                dense_params(),
                two_d,
                placements=(Replicate(), Shard(0)),
                replica_mode="redundant",
            ),
            Case(
                "tp_fsdp",
                dense_params()[:5] + gram_params(),
                two_d,
                placements=(Shard(0), Shard(1)),
            ),
            Case("ep_fsdp", stacks, two_d, placements=(Shard(0), Shard(1))),
            Case(
                "ep_only",
                [*stacks, P((40, 24), placements=(Replicate(), Shard(0)))],
                two_d,
                placements=(Shard(0), Replicate()),
            ),
        ]
    return cases


def update_tolerance(precision: str) -> float:
    """Exact where communication and Newton–Schulz are fp32, else within bf16 rounding."""
    return EXACT if PRECISIONS[precision] == ("float32", "float32") else BF16_UPDATE


def parity_violations(err: dict[str, float], precision: str) -> list[str]:
    """The criteria that a case's errors (from :func:`run_case`) in ``precision`` break."""
    limit = update_tolerance(precision)
    broken = []
    if err["update_fro"] > limit:
        broken.append(f"update error {err['update_fro']:.2e} > {limit:g} (norm-wise)")
    if err["bf16_param"] > BF16_PARAM:
        broken.append(f"bf16 parameter error {err['bf16_param']:.2e} > {BF16_PARAM:g}")
    return broken


def case_names(world_size: int) -> list[str]:
    return [case.name for case in cases_for(world_size)]


def parity_worker(
    rank: int,
    world_size: int,
    name: str,
    comm_dtype: str,
    ns_dtype: str,
    device: str = "cpu",
    rule: str = "muon",
) -> dict[str, float]:
    """Run the layout case ``name`` on this rank (gloo on CPU, or NCCL on ``"cuda"``) under
    the update ``rule`` of every Muon group."""
    (case,) = [c for c in cases_for(world_size) if c.name == name]
    comm, ns = getattr(torch, comm_dtype), getattr(torch, ns_dtype)
    return run_case(case, comm, ns, world_size, device, rule)
