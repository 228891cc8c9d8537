"""muon_dist's torchtitan optimizer container on a real torchtitan model (FSDP2, gloo).

torchtitan's language models attend with FlexAttention, which has no backward on CPU, so
these cases step on synthetic gradients: they check the container's routing of torchtitan's
names, its steps, and a resume through torchtitan's flat checkpoint state and DCP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def _model(world_size: int) -> nn.Module:
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]  # one dense layer, one MoE layer
    torch.manual_seed(0)
    model = config.build()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _container(model: nn.Module) -> Any:
    from muon_dist.integrations.torchtitan import MuonOptimizersContainer

    config = MuonOptimizersContainer.Config(
        lr=0.02,
        adamw_lr=1e-3,
        muon_options={"comm_dtype": torch.float32, "ns_dtype": torch.float32},
    )
    return config.build(model_parts=[model])


def _step(model: nn.Module, container: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen)
        assert isinstance(p, DTensor)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    container.step()
    container.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]


def resume_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model = _model(world_size)
    container = _container(model)
    table = container.optimizers[0].routing_table()
    for seed in (1, 2):
        _step(model, container, seed)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": container.state_dict()},
        checkpoint_id=Path(folder),
    )
    _step(model, container, 3)
    straight = _full(model)

    fresh = _model(world_size)
    fresh_container = _container(fresh)
    state = {"model": get_model_state_dict(fresh), "optim": fresh_container.state_dict()}
    dcp.load(state, checkpoint_id=Path(folder))
    set_model_state_dict(fresh, state["model"])
    fresh_container.load_state_dict(state["optim"])
    _step(fresh, fresh_container, 3)
    resumed = _full(fresh)
    mismatched = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    return {"table": table, "mismatched": mismatched}
