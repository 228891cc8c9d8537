"""The per-step gradient check: a gradient lies like its parameter, or the step refuses it
with a message that says how to fix it; and the reading of every parameter's local
gradient, each gradient tensor checked once."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

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
    new view); any other gradient takes the whole check, which names what differs.

    FSDP2 wraps every gradient it reduces in its parameter's own sharding spec (the same
    object): such a gradient lies like the parameter by construction (the same mesh,
    placements and global shape, and a DTensor's local shard is its spec's), so an identity
    test is its whole check."""

    def __init__(self, name: str, p: torch.Tensor) -> None:
        self.name, self.param = name, p
        self.mesh = p.device_mesh if isinstance(p, DTensor) else None  # None: not sharded
        self.placements = tuple(p.placements) if isinstance(p, DTensor) else ()
        self.spec = p._spec if isinstance(p, DTensor) else None
        self.shape = local(p).shape

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        """The local shard of ``grad``, checked as :func:`check_grad` checks it."""
        if isinstance(grad, DTensor) and grad._spec is self.spec:
            return grad._local_tensor
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


class GradReader:
    """The local gradient shards of ``params`` (``names`` for the messages), read at each
    step. A gradient kept between steps is checked and unwrapped only once, and a step
    whose gradients are all the last read's tensors costs one identity test per
    parameter (its presence flags then are the last read's too)."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._checks = [GradCheck(name, p) for name, p in zip(names, params, strict=True)]
        self._sources: list[torch.Tensor | None] = [None] * len(self.params)
        self._unwrapped: list[torch.Tensor | None] = [None] * len(self.params)
        self._present: list[bool] | None = None

    def read(self) -> tuple[list[torch.Tensor | None], list[bool], bool]:
        """Every local gradient (None where absent), whether each is present, and whether
        any is another tensor than at the last read. Raises the check's error for a
        gradient that does not lie like its parameter."""
        # Past DTensor's __torch_function__: its .grad and the checks' attribute reads
        # cost several times more through it.
        with torch._C.DisableTorchFunctionSubclass():
            grads = [p.grad for p in self.params]
            present = self._present  # None: never read, or a hook read a new gradient since
            fresh = present is None or not all(map(operator.is_, grads, self._sources))
            if present is None or fresh:
                sources = self._sources
                self._take([i for i, grad in enumerate(grads) if grad is not sources[i]], grads)
                present = self._present = [g is not None for g in self._unwrapped]
        return list(self._unwrapped), present, fresh

    def one(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s local gradient (a gradient hook's read)."""
        grad = self.params[index].grad
        if grad is not self._sources[index]:
            self._take((index,), {index: grad})
            self._present = None
        return self._unwrapped[index]

    def _take(
        self,
        taken: Sequence[int],
        grads: Sequence[torch.Tensor | None] | Mapping[int, torch.Tensor | None],
    ) -> None:
        """Check and unwrap the new gradients ``grads[i]`` of the parameters ``taken``, and
        keep both, with no call per parameter beyond its check: after
        ``zero_grad(set_to_none=True)`` every gradient is new. A refused gradient is kept
        as not taken, so the next read checks it again."""
        sources, unwrapped, checks = self._sources, self._unwrapped, self._checks
        for i in taken:
            grad = grads[i]
            unwrapped[i] = None if grad is None else checks[i](grad)
            sources[i] = grad
