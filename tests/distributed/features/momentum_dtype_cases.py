"""``momentum_dtype="bf16"`` on FSDP2-sharded parameters (gloo ranks), against the
single-device reference whose momentum is rounded to bf16 after each advance
(``bf16_momentum_reference``), and its DCP checkpoints.

Every rank builds the same full tensors, shards them with ``fully_shard`` (rows 41, 33 and
5 shard unevenly), steps with fp32 communication and Newton–Schulz, and compares its
gathered parameters and momenta with the reference run on the full tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from bf16_momentum_reference import Hyper, relative, step
from parity_cases import full_value, set_grads
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import muon_dist

SHAPES = [(16, 24), (41, 12), (33, 33), (5, 20)]
HYPER = Hyper()
STEPS = 3


def _data(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    starts = [torch.randn(s, generator=gen) for s in SHAPES]
    return starts, [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]


def _sharded(
    starts: list[torch.Tensor], world_size: int, **options: Any
) -> tuple[nn.Module, muon_dist.Muon]:
    module = nn.Module()
    for i, start in enumerate(starts):
        module.register_parameter(f"w{i}", nn.Parameter(start.clone()))
    fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    opt = muon_dist.Muon(
        module.named_parameters(),
        lr=HYPER.lr,
        momentum=HYPER.momentum,
        weight_decay=HYPER.weight_decay,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        **options,
    )
    return module, opt


def _train(module: nn.Module, opt: muon_dist.Muon, grads: list[list[torch.Tensor]]) -> None:
    params = list(module.parameters())
    for step_grads in grads:
        set_grads(params, step_grads)
        opt.step()


def bf16_momentum_worker(rank: int, world_size: int, rule: str) -> dict[str, Any]:
    """Per parameter: the local momentum's dtype, whether the gathered momentum equals the
    reference's bitwise, and the update's distance from the bf16 reference and from the
    fp32-momentum one (relative to the update, norm-wise)."""
    starts, grads = _data(11)
    module, opt = _sharded(starts, world_size, rule=rule, momentum_dtype="bf16")
    _train(module, opt, grads)
    out: dict[str, Any] = {"dtypes": [], "momenta": [], "bf16": [], "fp32": []}
    for i, p in enumerate(module.parameters()):
        momentum = opt.state[p]["momentum_buffer"]
        assert isinstance(momentum, DTensor)
        out["dtypes"].append(momentum.to_local().dtype)
        for store in (torch.bfloat16, torch.float32):
            want, stored = starts[i].clone(), torch.zeros(SHAPES[i], dtype=store)
            moment = torch.zeros(SHAPES[i][0])
            for step_grads in grads:
                step(want, step_grads[i], stored, HYPER, rule=rule, store=store, row_moment=moment)
            key = "bf16" if store == torch.bfloat16 else "fp32"
            out[key].append(relative(full_value(p), want, starts[i]))
            if store == torch.bfloat16:
                out["momenta"].append(torch.equal(momentum.full_tensor(), stored))
    return out


def dcp_worker(rank: int, world_size: int, path: str, saved_as: str | None) -> dict[str, Any]:
    """Two steps under ``momentum_dtype=saved_as``, a DCP checkpoint, loaded into a fresh
    bf16-momentum optimizer: whether its momenta are bf16 and equal, bitwise, to the saved
    ones rounded to bf16 (a bf16 checkpoint's exactly), and, for a bf16 checkpoint, the
    largest difference of parameters and momenta after one more step of both runs."""
    starts, grads = _data(12)
    module, opt = _sharded(starts, world_size, momentum_dtype=saved_as)
    _train(module, opt, grads[:2])
    model_sd, optim_sd = get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = [opt.state[p]["momentum_buffer"].full_tensor() for p in module.parameters()]
    resumed, resumed_opt = _sharded(starts, world_size, momentum_dtype="bf16")
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = [resumed_opt.state[p]["momentum_buffer"] for p in resumed.parameters()]
    out: dict[str, Any] = {
        "dtypes": {m.to_local().dtype for m in loaded},
        "group": resumed_opt.param_groups[0]["momentum_dtype"],
        "loaded": all(
            torch.equal(m.full_tensor(), s.bfloat16()) for m, s in zip(loaded, saved, strict=True)
        ),
    }
    if saved_as == "bf16":
        _train(module, opt, grads[2:])
        _train(resumed, resumed_opt, grads[2:])
        out["diff"] = max(
            max(
                (a.full_tensor() - b.full_tensor()).abs().max().item(),
                (opt.state[a]["momentum_buffer"].full_tensor().float())
                .sub(resumed_opt.state[b]["momentum_buffer"].full_tensor().float())
                .abs()
                .max()
                .item(),
            )
            for a, b in zip(module.parameters(), resumed.parameters(), strict=True)
        )
    return out
