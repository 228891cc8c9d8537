"""GPU check: on FSDP2 with real backward passes, the captured step equals the eager one,
and neither makes the host wait for the device (``set_sync_debug_mode("error")``).

Two identical FSDP2 models train side by side on the same batches under one lr schedule,
one with ``Muon(...)`` and one with ``Muon(..., cuda_graph=True)``; after every step the
full parameters must agree within bf16 rounding of one update. Exits 1 on a failure.

    torchrun --standalone --nproc-per-node 2 scripts/check_cuda_graph.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import muon_dist

LR, STEPS, WARMUP = 0.02, 8, 3
VOCAB, DIM, HIDDEN = 512, 256, 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(
    mesh: torch.distributed.device_mesh.DeviceMesh, cuda_graph: bool
) -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = Model().cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = muon_dist.Muon(
        muon_dist.param_groups(model, lr=LR, weight_decay=0.1), lr=LR, cuda_graph=cuda_graph
    )
    return model, opt


def main() -> int:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    runs = [build(mesh, cuda_graph=False), build(mesh, cuda_graph=True)]
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s)) for _, opt in runs
    ]
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    failures: list[str] = []
    worst = 0.0
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (4, 64), device="cuda", generator=gen)
        for (model, opt), scheduler in zip(runs, schedulers, strict=True):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            if step > WARMUP:
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            except RuntimeError as exc:
                failures.append(
                    f"step {step} ({'graph' if opt.settings.cuda_graph else 'eager'}): {exc}"
                )
            finally:
                torch.cuda.set_sync_debug_mode(0)
            scheduler.step()
            opt.zero_grad(set_to_none=False)
        for (name, a), b in zip(
            runs[0][0].named_parameters(), runs[1][0].parameters(), strict=True
        ):
            diff = (a.full_tensor() - b.full_tensor()).abs().max().item()
            worst = max(worst, diff)
            if not diff <= 2 * LR * 2**-8:
                failures.append(f"step {step}: {name} differs by {diff:.3e}")
    captured = runs[1][1]._step_runner().graph
    if captured is None or not captured.captured:
        failures.append("the cuda_graph=True optimizer never captured its step")
    for _, opt in runs:
        opt.check_finite()
    if rank == 0:
        print(
            f"FSDP2 x{dist.get_world_size()}: {STEPS} steps, "
            f"eager vs captured max |diff| {worst:.3e}"
        )
        print(
            "\n".join(failures) if failures else "OK: captured == eager, no host sync after warm-up"
        )
    del runs, schedulers, captured  # a captured graph holds NCCL work until it is freed
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
