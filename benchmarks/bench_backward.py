"""The backward-overlap mode of bench_step.py (``--backward``): a real training step.

A model with the preset's block shapes runs forward and backward (bf16 compute, fp32
parameters and reductions, FSDP2), then the optimizer steps. Timed per step, the slowest
rank's: forward+backward, the exposed optimizer time (end of backward to end of step:
what the training loop waits for) and their sum, for muon_dist with ``overlap="none"`` and
``overlap="backward"``, and torch's fused AdamW (foreach on CPU), with each one's peak
memory. Blocks: attention with 128-wide heads (grouped-query where wk is narrower than
wq) and either a SwiGLU MLP or experts, each token sent to one expert in turn (a fixed
routing, so every expert gets the same number of tokens and a gradient).

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_step.py --backward \
        --preset llama8b --layers 16
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --backward \
        --preset tiny --device cpu --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import muon_dist

HEAD_DIM_MAX = 128
PARAM_STD = 0.02
Shapes = dict[str, dict[str, tuple[int, ...]]]  # a block's parameter shapes, by sub-module


def _head_dim(rows: int, kv_rows: int) -> int:
    """The widest head size up to 128 dividing both projections (tiny presets have odd ones)."""
    for size in range(HEAD_DIM_MAX, 0, -1):
        if rows % size == 0 and kv_rows % size == 0:
            return size
    return 1


class Attention(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.head = _head_dim(shapes["wq"][0], shapes["wk"][0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = F.linear(x, self.wq).view(batch, tokens, -1, self.head).transpose(1, 2)
        k = F.linear(x, self.wk).view(batch, tokens, -1, self.head).transpose(1, 2)
        v = F.linear(x, self.wv).view(batch, tokens, -1, self.head).transpose(1, 2)
        # Grouped-query: query head h reads key/value head h·Hkv // Hq (any head counts).
        group = torch.arange(q.shape[1], device=x.device) * k.shape[1] // q.shape[1]
        k, v = k.index_select(1, group), v.index_select(1, group)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), self.wo)


class MLP(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class Experts(nn.Module):
    """``[E, out, in]`` expert stacks; token i goes to expert i mod E."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.w1.shape[0]
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0] - flat.shape[0] % experts
        grouped = flat[:rows].view(-1, experts, flat.shape[-1]).transpose(0, 1)  # [E, n, d]
        hidden = F.silu(grouped @ self.w1.transpose(1, 2)) * (grouped @ self.w3.transpose(1, 2))
        out = (hidden @ self.w2.transpose(1, 2)).transpose(0, 1).reshape(rows, -1)
        return torch.cat([out, flat[rows:]]).view_as(x)


class Block(nn.Module):
    def __init__(self, block: Shapes) -> None:
        super().__init__()
        self.attn = Attention(block["attn"])
        # Named as in real models: param_groups routes a module named "experts" as stacks.
        ffn: nn.Module = Experts(block["experts"]) if "experts" in block else MLP(block["mlp"])
        self.ffn = nn.ModuleDict({"experts" if "experts" in block else "mlp": ffn})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm residual branches, as the real blocks are: without the norms the
        # activations grow by the branches' gain per block and overflow bf16 within a few.
        x = x + self.attn(_norm(x))
        for ffn in self.ffn.values():
            x = x + ffn(_norm(x))
        return x


def _norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a weight: the timed parameters stay the preset's matrices."""
    return F.rms_norm(x, (x.shape[-1],))


class Model(nn.Module):
    def __init__(self, block: Shapes, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(block) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return _norm(x)


@torch.no_grad()
def build(block: Shapes, layers: int, mesh: DeviceMesh, device: torch.device) -> Model:
    """Shard on the meta device, then materialise each rank's shards only."""
    with torch.device("meta"):
        model = Model(block, layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    for p in model.parameters():
        p.to_local().normal_(0.0, PARAM_STD, generator=generator)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(values: list[float]) -> list[float]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [max(per_step) for per_step in zip(*gathered, strict=True)]


def _buckets(optimizer: torch.optim.Optimizer) -> int | None:
    muon = getattr(getattr(optimizer, "runner", None), "muon", None)
    return len(muon.plan.buckets) if muon is not None else None


def time_training(
    name: str,
    model: Model,
    make: Callable[[], torch.optim.Optimizer],
    inputs: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Warm-up then timed steps of forward+backward and step, with a fresh optimizer."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = make()
    fwd_bwd, exposed = [], []
    started: list[int] = []  # overlap="backward": buckets started by the end of backward
    held: list[float] = []  # and the MiB of updates they hold for step()
    for index in range(args.warmup + args.steps):
        optimizer.zero_grad()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        model(inputs).float().square().mean().backward()
        _sync(device)
        backward_done = time.perf_counter()
        early = getattr(getattr(optimizer, "runner", None), "early", None)
        if early is not None:
            started.append(early.started)
            held.append(early.held_bytes / 2**20)
        optimizer.step()
        _sync(device)
        end = time.perf_counter()
        if index >= args.warmup:
            fwd_bwd.append(backward_done - start)
            exposed.append(end - backward_done)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    optimizer.zero_grad()
    buckets = _buckets(optimizer)
    del optimizer
    fwd_bwd, exposed = _slowest(fwd_bwd), _slowest(exposed)
    totals = [a + b for a, b in zip(fwd_bwd, exposed, strict=True)]
    return {
        "name": name,
        "fwd_bwd_ms": statistics.median(fwd_bwd) * 1e3,
        "exposed_step_ms": statistics.median(exposed) * 1e3,
        "total_ms": statistics.median(totals) * 1e3,
        "peak_gib_per_rank": peaks,
        "buckets_started_in_backward": min(started) if started else None,
        "buckets": buckets,
        "held_mib_at_backward_end": max(held) if held else None,
    }


def run_backward(
    args: argparse.Namespace,
    block: Shapes,
    device: torch.device,
    mesh: DeviceMesh,
    muon_options: dict[str, Any],
) -> dict[str, Any]:
    """Time plain Muon, Muon overlapped with backward, and AdamW on the same model."""
    model = build(block, args.layers, mesh, device)
    dim = block["attn"]["wq"][1]
    generator = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    inputs = torch.randn(1, args.tokens, dim, device=device, generator=generator)
    inputs = inputs.to(torch.bfloat16 if device.type == "cuda" else torch.float32)

    def muon(overlap: str) -> Callable[[], torch.optim.Optimizer]:
        groups = muon_dist.param_groups(model, lr=0.02, weight_decay=0.1)
        return lambda: muon_dist.Muon(groups, overlap=overlap, **muon_options)

    def adamw() -> torch.optim.Optimizer:
        kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **kernel)

    rows = [
        time_training("muon_dist", model, muon("none"), inputs, args, device),
        time_training("muon_dist overlap=backward", model, muon("backward"), inputs, args, device),
        time_training("adamw", model, adamw, inputs, args, device),
    ]
    adamw_step = rows[-1]["exposed_step_ms"]
    for row in rows:
        row["exposed_vs_adamw_step"] = row["exposed_step_ms"] / adamw_step
        row["total_vs_adamw"] = row["total_ms"] / rows[-1]["total_ms"]
    return {"tokens_per_rank": args.tokens, "rows": rows}


def format_rows(report: dict[str, Any]) -> str:
    lines = [
        f"backward overlap, {report['tokens_per_rank']} tokens per rank:",
        "| optimizer | fwd+bwd ms | exposed step ms | total ms | exposed / AdamW step "
        "| total / AdamW | peak GiB (max rank) | buckets started in backward | held MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        peaks = [p for p in row["peak_gib_per_rank"] if p is not None]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        early = row["buckets_started_in_backward"]
        started = "-" if early is None else f"{early} of {row['buckets']}"
        mib = row["held_mib_at_backward_end"]
        held = "-" if mib is None else f"{mib:.0f}"
        lines.append(
            f"| {row['name']} | {row['fwd_bwd_ms']:.1f} | {row['exposed_step_ms']:.1f} | "
            f"{row['total_ms']:.1f} | {row['exposed_vs_adamw_step']:.2f} | "
            f"{row['total_vs_adamw']:.3f} | {peak} | {started} | {held} |"
        )
    return "\n".join(lines)
