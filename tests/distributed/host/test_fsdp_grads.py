"""Gradients FSDP2 makes are read with one identity test each: FSDP2 wraps every reduced
gradient in its parameter's own sharding spec, which
:class:`muon_dist.step.agree.grad_check.GradCheck` takes as the whole check. Gradients laid
out any other way still take the whole check, and one unlike its parameter is refused."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from muon_dist.step.agree import grad_check
from muon_dist.step.agree.grad_check import GradReader


def _fsdp_grads_worker(rank: int, world_size: int) -> list[str]:
    """What differs from the expected on this rank (empty: nothing)."""
    problems: list[str] = []
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    reader = GradReader([f"p{i}" for i in range(len(params))], params)

    def compared(*args: object) -> bool:
        problems.append("an FSDP2 gradient's mesh and placements were compared")
        return True

    for step in range(2):
        model(torch.randn(3, 6)).sum().backward()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(grad_check.GradCheck, "_placed_alike", compared)
            patch.setattr(grad_check, "check_grad", compared)
            grads, present, fresh = reader.read()
        for p, grad in zip(params, grads, strict=True):
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
            if p.grad._spec is not p._spec:
                problems.append(f"step {step}: FSDP2 made a gradient with a spec of its own")
            if grad is not p.grad._local_tensor:
                problems.append(f"step {step}: the read is not the gradient's local shard")
        if not (fresh and all(present)):
            problems.append(f"step {step}: fresh={fresh}, present={present}")
        model.zero_grad(set_to_none=True)
    # Laid out like its parameter but by hand (a spec of its own): the whole check, passed.
    p = params[0]
    assert isinstance(p, DTensor)
    local = torch.randn_like(p.to_local())
    mesh, placements = p.device_mesh, p.placements
    p.grad = DTensor.from_local(local, mesh, placements, shape=p.shape, stride=p.stride())
    if reader.read()[0][0] is not p.grad._local_tensor:
        problems.append("a gradient with a spec of its own was not read")
    # Laid out unlike its parameter: refused, naming the placements.
    p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"p0: gradient placements \(Replicate\(\),\)"):
        reader.read()
    return problems


def test_fsdp2_gradients_take_one_identity_test_and_others_the_whole_check() -> None:
    for problems in run_distributed(2, _fsdp_grads_worker, timeout=120):
        assert problems == []
