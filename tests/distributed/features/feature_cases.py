"""Attention and MoE features under sharding, each against a single-device reference.

Per-head and split orthogonalization, Magma and cautious weight decay are compared with
``reference_muon_step`` run on the separate row blocks of the full tensors, i.e. on separate
parameters; QK-clip with the clip written out on the full tensors, using logits maxed over
what every rank recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from parity_cases import full_value, set_grads
from reference_muon import reference_muon_step
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import muon_dist

STEPS = 3
BASE: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}
_REFERENCE_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "magma_beta", "ns_method")


@dataclass
class F:
    """One parameter: its name, full shape and group options."""

    name: str
    shape: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)


def view_params() -> list[F]:
    return [
        F("qkv", (25, 12), {"split_sizes": [15, 5, 5], "num_heads": [3, 1, 1]}),
        F("wq", (21, 16), {"num_heads": 3}),
        F("gate_up", (30, 12), {"split_sizes": [17, 13], "weight_decay": 0.0}),
        F(
            "qkv_magma",
            (25, 12),
            {"split_sizes": [15, 5, 5], "num_heads": [3, 1, 1], "magma": True, "cautious_wd": True},
        ),
        F("magma", (13, 9), {"magma": True, "magma_beta": 0.5}),
        F("experts", (4, 10, 6), {"experts": True, "magma": True, "cautious_wd": True}),
        F("fused_experts", (24, 9), {"num_experts": 4, "magma": True}),
        F("cautious", (18, 7), {"cautious_wd": True, "nesterov": False, "momentum": 0.9}),
        F(
            "qkv_gram",
            (25, 12),
            {"split_sizes": [15, 5, 5], "num_heads": [3, 1, 1], "ns_method": "gram"},
        ),
        F("experts_gram", (3, 8, 20), {"experts": True, "ns_method": "gram"}),
    ]


def clip_params() -> list[F]:
    return [
        F("mha.wq", (15, 8)),  # 3 heads of 5 rows: head boundaries straddle shards
        F("mha.wk", (15, 8), {"magma": True}),
        F("gqa.wq", (12, 8), {"num_heads": 4}),
        F("gqa.wk", (6, 8)),
        F("fused.wqkv", (24, 8), {"split_sizes": [8, 8, 8], "num_heads": [2, 2, 2]}),
    ]


CLIPS = [
    muon_dist.QKClip("mha", "mha.wq", "mha.wk", num_heads=3),
    muon_dist.QKClip("gqa", "gqa.wq", "gqa.wk", num_heads=4, num_kv_heads=2, tau=80.0),
    muon_dist.QKClip(
        "fused", "fused.wqkv", "fused.wqkv", num_heads=2, query_rows=(0, 8), key_rows=(8, 16)
    ),
]


def _logits(step: int, layer: int, rank: int, heads: int) -> torch.Tensor:
    """What ``rank`` records for a layer: head 0 stays under tau, the others mostly exceed it."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * layer + rank)
    logits = torch.randn(2, heads, 3, 3, generator=gen) * 60
    logits[:, 0] *= 0.2
    return logits


def _blocks(spec: F) -> list[tuple[int, int, tuple[int, int, int]]]:
    """(row start, row stop, (count, rows, cols)) of each separately orthogonalized block."""
    shape, options = spec.shape, spec.options
    if options.get("experts"):
        return [(0, shape[0], (shape[0], shape[1], shape[2]))]
    if "num_experts" in options:
        experts = options["num_experts"]
        return [(0, shape[0], (experts, shape[0] // experts, shape[1]))]
    sizes = options.get("split_sizes", [shape[0]])
    heads = options.get("num_heads", 1)
    heads = heads if isinstance(heads, list) else [heads] * len(sizes)
    out, start = [], 0
    for size, count in zip(sizes, heads, strict=True):
        out.append((start, start + size, (count, size // count, shape[1])))
        start += size
    return out


def _reference_clip(params: dict[str, torch.Tensor], peaks: list[torch.Tensor]) -> None:
    for spec, peak in zip(CLIPS, peaks, strict=True):
        gamma = torch.where(peak > spec.tau, spec.tau / peak, torch.ones_like(peak))
        q0, q1 = spec.query_rows or (0, params[spec.query].shape[0])
        k0, k1 = spec.key_rows or (0, params[spec.key].shape[0])
        query = params[spec.query][q0:q1].view(spec.num_heads, -1, 8)
        key = params[spec.key][k0:k1].view(spec.kv_heads, -1, 8)
        if spec.kv_heads < spec.num_heads:
            query.mul_(gamma.view(-1, 1, 1))
        else:
            query.mul_(gamma.sqrt().view(-1, 1, 1))
            key.mul_(gamma.sqrt().view(-1, 1, 1))


def _reference(
    specs: list[F],
    fulls: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    world_size: int,
    clip: bool,
) -> list[torch.Tensor]:
    params = [f.clone() for f in fulls]
    moms = [torch.zeros_like(f) for f in fulls]
    scores = [torch.ones(sum(b[2][0] for b in _blocks(s))) for s in specs]
    for step, step_grads in enumerate(grads):
        for p, g, m, score, spec in zip(params, step_grads, moms, scores, specs, strict=True):
            hp = {**BASE, **{k: v for k, v in spec.options.items() if k in _REFERENCE_KEYS}}
            first = 0
            for start, stop, matrices in _blocks(spec):
                count = matrices[0]
                reference_muon_step(
                    p[start:stop],
                    g[start:stop],
                    m[start:stop],
                    matrices=matrices,
                    magma_score=score[first : first + count] if spec.options.get("magma") else None,
                    cautious_wd=spec.options.get("cautious_wd", False),
                    ns_dtype=torch.float32,
                    **hp,
                )
                first += count
        if clip:
            peaks = [
                torch.stack(
                    [
                        _logits(step, i, r, c.num_heads).amax(dim=(0, 2, 3))
                        for r in range(world_size)
                    ]
                ).amax(0)
                for i, c in enumerate(CLIPS)
            ]
            _reference_clip({s.name: p for s, p in zip(specs, params, strict=True)}, peaks)
    return params


def _distribute(layout: str, fulls: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    if layout == "replicated":
        return [nn.Parameter(f.clone()) for f in fulls]
    if layout == "fsdp":
        module = nn.Module()
        for i, f in enumerate(fulls):
            module.register_parameter(f"p{i}", nn.Parameter(f.clone()))
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
        return [getattr(module, f"p{i}") for i in range(len(fulls))]
    mesh = init_device_mesh("cpu", (2, world_size // 2))  # "hsdp"
    return [
        nn.Parameter(distribute_tensor(f.clone(), mesh, [Replicate(), Shard(0)])) for f in fulls
    ]


def run_feature_case(specs: list[F], layout: str, world_size: int, clip: bool = False) -> float:
    """Max error of the sharded run relative to each parameter's total change; fp32
    communication and Newton–Schulz, so the features are compared exactly."""
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(99)
    fulls = [torch.randn(s.shape, generator=gen) for s in specs]
    # Gradients share a direction across steps so that Magma's cosine varies.
    base = [torch.randn(s.shape, generator=gen) for s in specs]
    grads = [
        [b * (-1) ** (t + i) + torch.randn(b.shape, generator=gen) for i, b in enumerate(base)]
        for t in range(STEPS)
    ]
    params = _distribute(layout, fulls, world_size)
    groups = [
        {"params": [p], "param_names": [s.name], "algorithm": "muon", **BASE, **s.options}
        for p, s in zip(params, specs, strict=True)
    ]
    tracker = muon_dist.MaxLogitTracker()
    opt = muon_dist.Muon(
        groups,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        qk_clip=CLIPS if clip else (),
        max_logits=tracker if clip else None,
    )
    for step, step_grads in enumerate(grads):
        set_grads(params, step_grads)
        if clip:
            for i, c in enumerate(CLIPS):
                tracker.record(c.layer, _logits(step, i, rank, c.num_heads))
        opt.step()
    expected = _reference(specs, fulls, grads, world_size, clip)
    worst = 0.0
    for p, ref, full in zip(params, expected, fulls, strict=True):
        got = full_value(p)
        change = (ref - full).abs().max().item()
        worst = max(worst, (got - ref).abs().max().item() / max(change, 1e-30))
    return worst


def _magma_model(world_size: int) -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 13, bias=False), nn.Linear(13, 9, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    groups = [
        {"params": [model[0].weight], "param_names": ["0.weight"], "num_heads": None},
        {"params": [model[1].weight], "param_names": ["1.weight"], "split_sizes": [5, 4]},
    ]
    return model, muon_dist.Muon(groups, magma=True, comm_dtype=torch.float32)


def train(model: nn.Module, opt: muon_dist.Muon, steps: int, seed: int) -> None:
    """``steps`` steps on random inputs of width 8 from ``seed`` (shared by the NorMuon cases)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step()


def magma_checkpoint_round_trip(world_size: int, path: str) -> float:
    """Save model and optimizer (Magma scores included) with DCP, resume, compare."""
    model, opt = _magma_model(world_size)
    train(model, opt, 3, 0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, opt, 2, 1)
    resumed, resumed_opt = _magma_model(world_size)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    train(resumed, resumed_opt, 2, 1)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(opt.state[a]["magma_score"], resumed_opt.state[b]["magma_score"])
    return max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
    )


# name -> (parameters, layout, QK-clip on); "magma_dcp" is the checkpoint round trip.
LAYOUT_CASES: dict[str, tuple[Callable[[], list[F]], str, bool]] = {
    "views_fsdp": (view_params, "fsdp", False),
    "qk_clip_fsdp": (clip_params, "fsdp", True),
    "views_replicated": (view_params, "replicated", False),
    "views_hsdp": (view_params, "hsdp", False),
    "qk_clip_hsdp": (clip_params, "hsdp", True),
}


def feature_cases(world_size: int) -> list[str]:
    """The feature cases that run on ``world_size`` ranks."""
    names = ["views_fsdp", "qk_clip_fsdp"]
    if world_size == 2:
        names += ["views_replicated", "magma_dcp"]
    if world_size == 4:
        names += ["views_hsdp", "qk_clip_hsdp"]
    return names


def feature_worker(rank: int, world_size: int, name: str, checkpoint: str = "") -> float:
    """Run feature case ``name``; ``magma_dcp`` saves and resumes through ``checkpoint``."""
    if name == "magma_dcp":
        error = magma_checkpoint_round_trip(world_size, checkpoint)
    else:
        params, layout, clip = LAYOUT_CASES[name]
        error = run_feature_case(params(), layout, world_size, clip=clip)
    assert math.isfinite(error), f"{name}: {error}"
    return error
