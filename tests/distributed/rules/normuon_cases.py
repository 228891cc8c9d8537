"""NorMuon and Dion2 under sharding, against the plain reference run on each matrix
separately.

Every parameter is cut into its matrices by flat index (``matrices``): heads and row blocks,
parts cut on the owner (interleaved, and of ``[in, out]`` weights), experts and fused
experts; each matrix, taken by output rows, is stepped by ``reference_muon_step`` with its
own row moments. fp32 communication and Newton–Schulz, so sharded and single-device runs
agree to fp32 rounding. The checkpoint case saves at one world size and resumes at another.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from feature_cases import BASE, STEPS, F, train
from parity_cases import DION2_FRACTION, full_value, set_grads
from reference_muon import reference_muon_step
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import muon_dist

_REFERENCE_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "normuon_beta2", "normuon_eps")


def specs() -> list[F]:
    return [
        F("plain", (13, 9)),
        F("ties", (8, 12)),  # two equal rows compete for the last selected slot: see _tie
        F("wide", (5, 24), {"nesterov": False, "normuon_beta2": 0.9, "normuon_eps": 1e-6}),
        F("in_out", (12, 7), {"transposed": True}),
        F("qkv", (25, 12), {"split_sizes": [15, 5, 5], "num_heads": [3, 1, 1]}),
        F("gate_up", (20, 12), {"split_sizes": [6, 4], "split_groups": 2}),
        F("in_out_qkv", (12, 30), {"transposed": True, "split_sizes": [10, 20]}),
        F("experts", (4, 10, 6), {"experts": True}),
        F("expert_parts", (3, 10, 6), {"experts": True, "split_sizes": [6, 4]}),
        F("fused_experts", (24, 9), {"num_experts": 4}),
    ]


def _parts(out_in: torch.Tensor, options: dict[str, Any]) -> list[torch.Tensor]:
    """An ``[out, in]`` matrix of indices cut into its parts (or itself)."""
    sizes = options.get("split_sizes")
    if sizes is None:
        return [out_in]
    groups = options.get("split_groups", 1)
    x = out_in.reshape(groups, sum(sizes), out_in.shape[1])
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    return [
        x[:, o : o + s].reshape(-1, out_in.shape[1]) for o, s in zip(offsets, sizes, strict=True)
    ]


def matrices(spec: F) -> list[torch.Tensor]:
    """Each separately normalized matrix of a parameter as ``[out, in]`` flat indices."""
    flat = torch.arange(torch.Size(spec.shape).numel()).reshape(spec.shape)
    options = spec.options
    if options.get("experts"):
        return [m for e in flat for m in _parts(e, options)]
    if "num_experts" in options:
        return list(flat.reshape(options["num_experts"], -1, spec.shape[1]))
    if options.get("transposed"):
        return _parts(flat.T, options)
    if "num_heads" in options:
        out, start = [], 0
        for size, heads in zip(options["split_sizes"], options["num_heads"], strict=True):
            out += list(flat[start : start + size].reshape(heads, -1, spec.shape[1]))
            start += size
        return out
    return _parts(flat, options)


def reference(
    spec_list: list[F],
    fulls: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    rule: str = "normuon",
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The parameters and momenta after the steps under ``rule``, and (NorMuon) each one's
    row second moments laid out as the optimizer's state: output row after output row of
    the whole parameter."""
    params = [f.clone().reshape(-1) for f in fulls]
    moms = [torch.zeros_like(p) for p in params]
    cuts = [matrices(s) for s in spec_list]
    moments = [[torch.zeros(m.shape[0]) for m in c] for c in cuts]
    for step_grads in grads:
        for p, g, m, spec, cut, vs in zip(
            params, step_grads, moms, spec_list, cuts, moments, strict=True
        ):
            hp = {**BASE, **{k: v for k, v in spec.options.items() if k in _REFERENCE_KEYS}}
            g = g.reshape(-1)
            for index, v in zip(cut, vs, strict=True):
                p2, m2 = p[index], m[index]
                rule_options: dict[str, Any] = (
                    {"row_moment": v} if rule == "normuon" else {"dion2_fraction": DION2_FRACTION}
                )
                reference_muon_step(p2, g[index], m2, ns_dtype=torch.float32, **rule_options, **hp)
                p[index], m[index] = p2, m2
    states = []
    for spec, cut, vs in zip(spec_list, cuts, moments, strict=True):
        state = torch.zeros(sum(v.numel() for v in vs))
        for index, v in zip(cut, vs, strict=True):
            first = index[:, 0]  # each output row's first element, by flat index
            rows = (
                first % spec.shape[1] if spec.options.get("transposed") else first // spec.shape[-1]
            )
            state[rows] = v
        states.append(state)
    shaped = [p.reshape(f.shape) for p, f in zip(params, fulls, strict=True)]
    return shaped, states, [m.reshape(f.shape) for m, f in zip(moms, fulls, strict=True)]


def _tie(spec_list: list[F], tensors: list[torch.Tensor]) -> None:
    """In the "ties" matrix, row 0 dominates and rows 1 and 2 are equal and next: with 2 of
    its 8 rows selected, the second slot is a tie, which the lower index wins."""
    t = tensors[[s.name for s in spec_list].index("ties")]
    t[0] *= 10.0
    t[2] = t[1]
    t[1:3] *= 5.0


def _distribute(layout: str, fulls: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    if layout == "replicated":
        return [nn.Parameter(f.clone()) for f in fulls]
    if layout == "fsdp":
        module = nn.Module()
        for i, f in enumerate(fulls):
            module.register_parameter(f"p{i}", nn.Parameter(f.clone()))
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
        return [getattr(module, f"p{i}") for i in range(len(fulls))]
    mesh = init_device_mesh("cpu", (2, world_size // 2))
    # "hsdp_*": replicated over the first dim; "2d": tensor (experts: expert) parallel
    # over the first, FSDP-like Shard(1) over the second.
    placements = [Shard(0), Shard(1)] if layout == "2d" else [Replicate(), Shard(0)]
    return [nn.Parameter(distribute_tensor(f.clone(), mesh, placements)) for f in fulls]


def run_layout(layout: str, world_size: int, rule: str = "normuon") -> float:
    """Max error of the sharded run under ``rule`` relative to each parameter's total
    change (weights, and under Dion2 also the momenta, which show its error feedback)."""
    spec_list = specs()
    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randn(s.shape, generator=gen) for s in spec_list]
    grads = [[torch.randn(s.shape, generator=gen) for s in spec_list] for _ in range(STEPS)]
    for tensors in (fulls, *grads):
        _tie(spec_list, tensors)
    params = _distribute(layout, fulls, world_size)
    groups = [
        {"params": [p], "param_names": [s.name], "algorithm": "muon", **BASE, **s.options}
        for p, s in zip(params, spec_list, strict=True)
    ]
    opt = muon_dist.Muon(
        groups,
        rule=rule,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        replica_mode="redundant" if layout == "hsdp_redundant" else "split",
    )
    for step_grads in grads:
        set_grads(params, step_grads)
        opt.step()
    expected, expected_moments, expected_momenta = reference(spec_list, fulls, grads, rule)
    if rule == "normuon":
        moments = [opt.state[p]["row_second_moment"] for p in params]
        _assert_moments_agree(moments)
        for moment, want in zip(moments, expected_moments, strict=True):
            torch.testing.assert_close(moment, want, rtol=1e-5, atol=1e-9)
    worst = 0.0
    for p, ref, full in zip(params, expected, fulls, strict=True):
        change = (ref - full).abs().max().item()
        worst = max(worst, (full_value(p) - ref).abs().max().item() / max(change, 1e-30))
    if rule == "dion2":  # the error feedback: only the selected slices' momenta decayed
        for p, want in zip(params, expected_momenta, strict=True):
            got = full_value(opt.state[p]["momentum_buffer"])
            scale = want.abs().max().item()
            worst = max(worst, (got - want).abs().max().item() / max(scale, 1e-30))
    return worst


def _assert_moments_agree(moments: list[torch.Tensor]) -> None:
    """Every rank holds the same second moments, bitwise (each is a replicated copy)."""
    world = torch.distributed.get_world_size()
    for moment in moments:
        copies = [torch.empty_like(moment) for _ in range(world)]
        torch.distributed.all_gather(copies, moment)
        for other in copies:
            assert torch.equal(other, moment), "NorMuon's row moments differ across ranks"


def _model(world_size: int, rule: str) -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 13, bias=False), nn.Linear(13, 9, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    groups = [
        {"params": [model[0].weight], "param_names": ["0.weight"]},
        {"params": [model[1].weight], "param_names": ["1.weight"], "split_sizes": [5, 4]},
    ]
    opt = muon_dist.Muon(groups, rule=rule, comm_dtype=torch.float32, ns_dtype=torch.float32)
    return model, opt


def _full_state(model: nn.Module, opt: muon_dist.Muon) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out += [full_value(p), full_value(opt.state[p]["momentum_buffer"])]
        if "row_second_moment" in opt.state[p]:
            out.append(opt.state[p]["row_second_moment"])
    return [t.detach().clone() for t in out]


def save(world_size: int, path: str, rule: str) -> list[torch.Tensor]:
    """Train 3 steps and save through DCP, then 2 more; returns the final full state."""
    model, opt = _model(world_size, rule)
    train(model, opt, 3, 0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, opt, 2, 1)
    return _full_state(model, opt)


def resume(world_size: int, path: str, rule: str) -> list[torch.Tensor]:
    """Load the checkpoint on ``world_size`` ranks and take the same 2 steps."""
    model, opt = _model(world_size, rule)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, 2, 1)
    return _full_state(model, opt)


def layouts(world_size: int) -> list[str]:
    names = ["fsdp"]
    if world_size == 2:
        names.append("replicated")
    if world_size == 4:
        names += ["hsdp_split", "hsdp_redundant", "2d"]
    return names


def normuon_worker(
    rank: int, world_size: int, case: str, path: str = "", rule: str = "normuon"
) -> Any:
    """A layout's error, or ``save``/``resume``'s full state, on this rank, under ``rule``."""
    if case == "save":
        return save(world_size, path, rule)
    if case == "resume":
        return resume(world_size, path, rule)
    return run_layout(case, world_size, rule)
