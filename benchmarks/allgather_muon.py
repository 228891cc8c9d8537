"""All-gather Muon: the plain distributed baseline that benchmarks/bench_step.py measures against.

This is the obvious way to run Muon under FSDP2: every rank all-gathers every whole matrix,
runs Newton–Schulz on all of them, and keeps its own shard of each result. Each rank thus
receives every matrix (about W times the bytes muon_dist moves) and repeats all of the
Newton–Schulz work (W times the FLOPs). It is written independently of muon_dist's planner
(DTensor's own gather and chunking, its own lr scale) so that agreement on the first step is
evidence that muon_dist's plan, packing and scatter are right, not a copy of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from muon_dist.kernels import newton_schulz


class AllGatherMuon(torch.optim.Optimizer):
    """Muon on FSDP2 parameters by gathering every matrix to every rank.

    The math is muon_dist.Muon's with ``adjust_lr="spectral_norm"``: ``M = mu*M + G``, Nesterov
    input ``G + mu*M``, Newton–Schulz in bf16, ``W = W*(1 - lr*wd) - lr*sqrt(max(1, rows/cols))*O``.
    2-D parameters are one matrix; 3-D parameters are stacks of matrices over dim 0 (experts).
    The gathered update is cast to ``comm_dtype`` first, as muon_dist casts what it sends:
    Newton–Schulz casts its input to bf16 anyway, so the cast changes bytes moved, not results.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        coefficients: str = "quintic",
        backend: str = "auto",
        comm_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.ns_steps = ns_steps
        self.coefficients = coefficients
        self.backend = backend
        self.comm_dtype = comm_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor) or p.ndim not in (2, 3):
                    raise ValueError(
                        f"AllGatherMuon takes 2-D or 3-D DTensor parameters, got a "
                        f"{type(p).__name__} of shape {tuple(p.shape)}"
                    )
                # Allocated up front, as muon_dist.Muon does, so peak memory compares fairly.
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("AllGatherMuon.step takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _update(self, p: DTensor, group: dict[str, Any]) -> None:
        """One parameter: momentum on the shard, gather, orthogonalize, keep this rank's part.

        Parameters are done one at a time so only one full matrix (stack) and its
        Newton–Schulz temporaries are alive at once.
        """
        lr, mu = group["lr"], group["momentum"]
        grad = p.grad.to_local()
        momentum = self.state[p]["momentum_buffer"].to_local()
        momentum.mul_(mu).add_(grad)
        update = grad.add(momentum, alpha=mu) if group["nesterov"] else momentum
        full = DTensor.from_local(
            update.to(self.comm_dtype),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        ).full_tensor()
        ortho = newton_schulz(
            full, steps=self.ns_steps, coefficients=self.coefficients, backend=self.backend
        )
        # Every rank holds the same full result, so chunking it locally (no source rank)
        # yields exactly this rank's shard, with no communication.
        mine = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        rows, cols = p.shape[-2:]
        weight = p.to_local()
        weight.mul_(1.0 - lr * group["weight_decay"])
        weight.add_(mine.to_local(), alpha=-lr * math.sqrt(max(1.0, rows / cols)))
