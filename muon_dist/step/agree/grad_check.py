"""The per-step gradient check: a gradient lies like its parameter, or the step refuses it
with a message that says how to fix it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from muon_dist.state.tensors import local


def check_grad(name: str, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The local shard of ``p``'s gradient, after checking that it lies like ``p``: dense,
    on the same mesh with the same placements, of the same local shape."""
    if grad.layout != torch.strided:
        raise TypeError(
            f"{name} has a sparse gradient ({grad.layout}); this optimizer takes dense "
            "gradients: build the layer with sparse=False or call grad.to_dense()"
        )
    if isinstance(p, DTensor) != isinstance(grad, DTensor):
        kind = "a DTensor" if isinstance(p, DTensor) else "a plain tensor"
        raise ValueError(
            f"{name}: the parameter is {kind} but its gradient is not; give it a gradient "
            "of the parameter's kind"
        )
    if isinstance(p, DTensor) and isinstance(grad, DTensor):
        if grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
            raise ValueError(
                f"{name}: gradient placements {tuple(grad.placements)} on mesh "
                f"{tuple(grad.device_mesh.shape)} differ from the parameter's "
                f"{tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)}; redistribute "
                "it first: p.grad = grad.redistribute(p.device_mesh, p.placements)"
            )
        grad, p = grad.to_local(), p.to_local()
    if grad.shape != p.shape:
        raise ValueError(
            f"{name}: gradient shape {tuple(grad.shape)} differs from the parameter's "
            f"{tuple(p.shape)}"
        )
    return grad


class GradCheck:
    """:func:`check_grad` of one parameter, its layout read once: a gradient that lies like
    it costs a few comparisons and no operation (``p.to_local()`` of a parameter takes a
    new view); any other gradient takes the whole check, which names what differs."""

    def __init__(self, name: str, p: torch.Tensor) -> None:
        self.name, self.param = name, p
        self.mesh = p.device_mesh if isinstance(p, DTensor) else None  # None: not sharded
        self.placements = tuple(p.placements) if isinstance(p, DTensor) else ()
        self.shape = local(p).shape

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        """The local shard of ``grad``, checked as :func:`check_grad` checks it."""
        if grad.layout == torch.strided:
            if isinstance(grad, DTensor):
                shard = grad._local_tensor
                if self.mesh is not None and shard.shape == self.shape and self._placed_alike(grad):
                    return shard
            elif self.mesh is None and grad.shape == self.shape:
                return grad
        return check_grad(self.name, self.param, grad)

    def _placed_alike(self, grad: DTensor) -> bool:
        mesh = grad.device_mesh
        return (mesh is self.mesh or mesh == self.mesh) and grad.placements == self.placements
