"""FSDP2 with real backward passes on NCCL: captured step vs eager step, run on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
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


def _build(mesh: DeviceMesh, cuda_graph: bool | str) -> tuple[nn.Module, muon_dist.Muon]:
    torch.manual_seed(0)
    model = Model().cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = muon_dist.param_groups(model, lr=LR, weight_decay=0.1)
    return model, muon_dist.Muon(groups, lr=LR, cuda_graph=cuda_graph)


def fsdp_capture_worker(rank: int, world_size: int, set_to_none: bool = False) -> dict[str, object]:
    """Two identical FSDP2 models on the same batches under one lr schedule, one eager and
    one captured (``cuda_graph="auto"`` where gradients are freed between steps,
    ``True`` where they are kept); every optimizer step after warm-up runs under sync debug
    mode "error".

    Returns the worst parameter difference, the sync errors seen and whether it captured.
    """
    mesh = init_device_mesh("cuda", (world_size,))
    runs = [
        _build(mesh, cuda_graph=False),
        _build(mesh, cuda_graph="auto" if set_to_none else True),
    ]
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s)) for _, opt in runs
    ]
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    syncs: list[str] = []
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
                syncs.append(f"step {step}, cuda_graph={opt.settings.cuda_graph}: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            scheduler.step()
            opt.zero_grad(set_to_none=set_to_none)
        for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
            worst = max(worst, (a.full_tensor() - b.full_tensor()).abs().max().item())
    graph = runs[1][1].runner.graph
    captured = graph is not None and graph.captured
    for _, opt in runs:
        opt.check_finite()
    del runs, schedulers, graph  # a captured graph holds NCCL work until it is freed
    dist.barrier()
    return {"worst": worst, "syncs": syncs, "captured": captured}
