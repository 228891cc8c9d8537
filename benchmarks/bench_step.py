"""Time one optimizer step on an FSDP2 model: muon_dist vs all-gather Muon vs fused AdamW.

All three run in the same process group on the same parameters, one after another, each with
its own fresh state, so their times and peak memory compare directly. The Newton–Schulz FLOP
floor (standard FLOPs over all Muon matrices / W GPUs / measured bf16 matmul rate) is the
yardstick: a perfectly balanced, perfectly overlapped Muon step cannot beat it. Before timing,
the first step of muon_dist and of the all-gather baseline are compared on identical inputs;
the script exits 1 if they disagree beyond bf16 rounding (after writing the JSON). On CUDA,
muon_dist is also timed with its step captured in a CUDA graph (``cuda_graph=True``).

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_step.py --preset llama8b \
        --sweep-inflight 1,2,3,4 --json $OUT/bench_step_llama8b.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --preset small224
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step.py --preset tiny --device cpu

``--backward`` times whole training steps instead, with and without ``overlap="backward"``
(:mod:`bench_backward`). ``--from-json PATH --write-table`` records a finished run's step
and host rows from its ``--json`` (which keeps its run's device, versions and command), so
a GPU machine need only return that file.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_backward
import comm_bytes
import tables
import torch
import torch.distributed as dist
from allgather_muon import AllGatherMuon
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import muon_dist
from muon_dist.kernels import BACKENDS, COEFFICIENT_SETS
from muon_dist.kernels.gram import METHODS as NS_METHODS
from muon_dist.plan.build import REPLICA_MODES, ns_cost
from muon_dist.plan.views import matrix_view
from muon_dist.rules.registry import RULES

LR = 0.02
MOMENTUM = 0.95
WEIGHT_DECAY = 0.1  # non-zero so the parity check covers decoupled decay too
# The update rule every muon_dist step here is timed with (profile_step.py and
# bench_lanes.py build their Muon from it too).
MUON_RULE: dict[str, Any] = {
    "lr": LR,
    "momentum": MOMENTUM,
    "nesterov": True,
    "weight_decay": WEIGHT_DECAY,
    "adjust_lr": "spectral_norm",
}
ADAMW_LR = 3e-4
PARAM_STD = 0.02
# First-step updates of muon_dist and the baseline may differ only where the two run bf16
# Newton–Schulz through differently batched kernels: another tile size sums in another order,
# which flips some bf16 roundings (simulated on CPU: ~3e-3 relative); a wrong shard, lr scale
# or packing shows up as 1e-1 or more.
PARITY_TOL = 2e-2
GIB = 2**30
MIB = 2**20
START = time.perf_counter()


@dataclass(frozen=True)
class Preset:
    """Parameter shapes of one transformer block, by sub-module name, and a default depth."""

    block: dict[str, dict[str, tuple[int, ...]]]
    layers: int


PRESETS = {
    "llama8b": Preset(
        {
            "attn": {
                "wq": (4096, 4096),
                "wk": (1024, 4096),
                "wv": (1024, 4096),
                "wo": (4096, 4096),
            },
            "mlp": {"w1": (14336, 4096), "w3": (14336, 4096), "w2": (4096, 14336)},
        },
        layers=32,
    ),
    "qwen3moe": Preset(
        {
            "attn": {"wq": (4096, 2048), "wk": (512, 2048), "wv": (512, 2048), "wo": (2048, 4096)},
            "experts": {"w1": (128, 768, 2048), "w3": (128, 768, 2048), "w2": (128, 2048, 768)},
        },
        layers=8,
    ),
    # llama8b's seven shapes at 1/16 of their dimensions: 224 tiny matrices, so the GPU work
    # is negligible and the step time is the host's fixed cost (launches, collectives).
    "small224": Preset(
        {
            "attn": {"wq": (256, 256), "wk": (64, 256), "wv": (64, 256), "wo": (256, 256)},
            "mlp": {"w1": (896, 256), "w3": (896, 256), "w2": (256, 896)},
        },
        layers=32,
    ),
    # Odd sizes on purpose: 65 and 689 rows shard unevenly over 2 or 4 ranks, and 5 experts
    # over 4 ranks leave one rank an empty shard, so the CPU smoke test covers those layouts.
    "tiny": Preset(
        {
            "attn": {"wq": (256, 256), "wk": (65, 256), "wv": (65, 256), "wo": (256, 256)},
            "mlp": {"w1": (689, 256), "w3": (689, 256), "w2": (256, 689)},
            "experts": {"w1": (5, 96, 256), "w3": (5, 96, 256), "w2": (5, 256, 96)},
        },
        layers=2,
    ),
}


class ParamBag(nn.Module):
    """Named parameters and nothing else: the optimizer step needs only shapes and layouts."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))


class Block(nn.Module):
    """One transformer block's parameters; a plain Module since fully_shard rejects containers."""

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        for part, shapes in preset.block.items():
            self.add_module(part, ParamBag(shapes))


class Model(nn.Module):
    """A stack of blocks named like a real model, so param_groups routes them as it would."""

    def __init__(self, preset: Preset, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(preset) for _ in range(layers))


def build_model(preset: Preset, layers: int, mesh: DeviceMesh, device: torch.device) -> Model:
    """Shard on the meta device first, so no rank ever materialises the full fp32 model."""
    with torch.device("meta"):
        model = Model(preset, layers)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    for index, p in enumerate(model.parameters()):
        p.to_local().normal_(0.0, PARAM_STD, generator=shard_generator(p, index))
    return model


def shard_generator(p: DTensor, seed: int) -> torch.Generator:
    """A generator seeded by the shard, not the rank: HSDP replicas of one shard draw equal
    values (as a real gradient all-reduce would leave them) and distinct shards differ."""
    shard = 0
    coords = p.device_mesh.get_coordinate()
    assert coords is not None, "every rank is in the mesh"
    for coord, size, placement in zip(coords, p.device_mesh.shape, p.placements, strict=True):
        if placement.is_shard():
            shard = shard * size + coord
    return torch.Generator(device=p.device).manual_seed(seed * 65536 + shard)


def set_random_grads(params: Sequence[DTensor]) -> None:
    """Standard-normal gradients, placed like their parameters, kept for every step."""
    for index, p in enumerate(params):
        local = torch.empty_like(p.to_local())
        local.normal_(generator=shard_generator(p, len(params) + index))
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


# ---------------------------------------------------------------------------------------
# Measurement helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop the previous method's optimizer state so it neither crowds nor inflates the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def all_ranks(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def time_steps(
    step: Callable[[], Any], warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Seconds per timed step, each the slowest rank's: a distributed step ends with its last rank.

    The barrier before the start keeps one rank's leftover work out of the next step, and the
    one before the stop makes every rank's clock include the collectives' slowest partner.
    """
    for _ in range(warmup):
        step()
    mine = []
    for _ in range(steps):
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        sync(device)
        dist.barrier()
        mine.append(time.perf_counter() - start)
    return [max(per_step) for per_step in zip(*all_ranks(mine), strict=True)]


def matmul_tflops(size: int, device: torch.device, repeats: int = 10) -> float:
    """This rank's bf16 matmul rate in TFLOP/s: the rate Newton–Schulz could reach at best."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(2):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(times) / 1e12


def ns_flops(groups: Sequence[dict[str, Any]], steps: int) -> tuple[float, int]:
    """Standard Newton–Schulz FLOPs of one step over every Muon matrix, and the matrix count,
    from the same matrix views muon_dist orthogonalizes (experts count one matrix each)."""
    flops, matrices = 0.0, 0
    for group in groups:
        if group["algorithm"] != "muon":
            continue
        for p in group["params"]:
            view = matrix_view(
                p.shape,
                muon_mode=group.get("muon_mode", "2d"),
                experts=group.get("experts", False),
                num_experts=group.get("num_experts"),
            )
            flops += view.count * ns_cost(view.rows, view.cols, steps)
            matrices += view.count
    return flops, matrices


# ---------------------------------------------------------------------------------------
# The comparison


def worse(current: float, value: float) -> float:
    """The larger error, with NaN or inf counted as infinite (plain max would drop a NaN)."""
    return max(current, value) if math.isfinite(value) else math.inf


def check_parity(
    params: Sequence[DTensor],
    make_muon: Callable[[], torch.optim.Optimizer],
    make_baseline: Callable[[], torch.optim.Optimizer],
    device: torch.device,
) -> dict[str, float]:
    """First step of both Muons from the same params, grads and zero momentum, compared.

    ``update_rel`` is max over parameters of ||Δ_muon_dist − Δ_allgather||_F / ||Δ_allgather||_F
    on this rank's shard (Δ = new − old param), the sensitive measure; ``shard_rel`` is
    max |new_muon_dist − new_allgather| / max |new_allgather| per shard. Both are maxima over
    ranks. Afterwards the params hold the baseline's first step.
    """
    start = [p.to_local().clone() for p in params]
    make_muon().step()
    muon_updates = [p.to_local() - s for p, s in zip(params, start, strict=True)]
    for p, s in zip(params, start, strict=True):
        p.to_local().copy_(s)
    free_memory(device)
    make_baseline().step()
    update_rel, shard_rel = 0.0, 0.0
    for p, s, update in zip(params, start, muon_updates, strict=True):
        new = p.to_local()
        if new.numel() == 0:
            continue
        baseline_update = new - s
        diff = update - baseline_update
        update_rel = worse(update_rel, (diff.norm() / baseline_update.norm()).item())
        shard_rel = worse(shard_rel, (diff.abs().max() / new.abs().max()).item())
    del start, muon_updates
    free_memory(device)
    worst = all_ranks((update_rel, shard_rel))
    return {
        "update_rel": max(u for u, _ in worst),
        "shard_rel": max(s for _, s in worst),
        "tolerance": PARITY_TOL,
    }


def time_method(
    name: str,
    make: Callable[[], torch.optim.Optimizer],
    args: argparse.Namespace,
    device: torch.device,
    counted: bool = True,
) -> dict[str, Any]:
    """Build a fresh optimizer, time its step, and report its peak memory including its state
    and, where ``counted``, the bytes each rank sent in one more step (:mod:`comm_bytes` sees
    torch.distributed's collectives only, not the baseline's functional ones)."""
    free_memory(device)
    optimizer = make()
    times = time_steps(optimizer.step, args.warmup, args.steps, device)
    peak = all_ranks(peak_gib(device))
    with comm_bytes.counting() as sent:
        optimizer.step()
    sync(device)
    del optimizer
    free_memory(device)
    return {
        "name": name,
        "times_ms": [t * 1e3 for t in times],
        "median_ms": statistics.median(times) * 1e3,
        "peak_gib_per_rank": peak,
        "sent_mib_per_rank": all_ranks(sent.total / MIB) if counted else None,
    }


def make_dion(root: Path, params: Sequence[DTensor], mesh: DeviceMesh) -> torch.optim.Optimizer:
    """microsoft/dion's Muon with its Triton Newton–Schulz and its default coefficients, at
    this benchmark's momentum, Nesterov, weight decay and lr scaling (a rival, imported from
    the folder the user names; nothing of it is part of this project)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from dion import Muon as DionMuon  # type: ignore[import-not-found]  # the rival, at run time

    optimizer: torch.optim.Optimizer = DionMuon(
        list(params),
        distributed_mesh=mesh,
        lr=LR,
        mu=MOMENTUM,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        adjust_lr="spectral_norm",
        use_triton=True,
    )
    return optimizer


def log(message: str) -> None:
    """Rank 0's progress, stamped with seconds since start to keep the run's budget in view."""
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


def print_table(report: dict[str, Any]) -> None:
    mesh = "x".join(str(s) for s in report["mesh_shape"])
    state = max(report["state_gib_per_rank"])
    parity = report["parity"]
    lines = [
        f"preset {report['preset']}: {report['layers']} layers, {report['params'] / 1e9:.3f}B "
        f"params, {report['muon_matrices']} Muon matrices; {report['world_size']} ranks, mesh "
        f"{mesh} ({', '.join(report['mesh_names'])}), {report['device']}",
        f"bf16 matmul {report['matmul_size']}^3: {report['matmul_tflops']:.1f} TFLOP/s per rank; "
        f"Newton–Schulz floor {report['floor_ms']:.2f} ms "
        f"({report['ns_flops'] / 1e12:.3g} TFLOP / {report['world_size']} ranks)",
        f"per rank: params+grads+momentum {state:.2f} GiB; bucket budget "
        f"{report['options']['bucket_mb']:g} MiB",
        *(
            [f"the timing's syncs and barriers around an empty step: {report['timing_ms']:.3f} ms"]
            if "timing_ms" in report  # reports written before it was measured lack it
            else []
        ),
        f"first-step parity muon_dist vs all-gather: update rel {parity['update_rel']:.2e}, "
        f"shard rel {parity['shard_rel']:.2e} (tolerance {parity['tolerance']:.0e}) -> "
        f"{'OK' if parity['ok'] else 'FAIL'}",
        "",
        f"{'method':<40} {'median ms':>10} {'x floor':>8} {'vs all-gather':>14} {'peak GiB':>9}"
        f" {'sent MiB':>9}",
    ]
    for row in report["methods"]:
        peaks = [p for p in row["peak_gib_per_rank"] if p is not None]
        peak = f"{max(peaks):9.2f}" if peaks else f"{'-':>9}"
        sent_mib = row["sent_mib_per_rank"]
        sent = f"{max(sent_mib):9.1f}" if sent_mib is not None else f"{'-':>9}"
        lines.append(
            f"{row['name']:<40} {row['median_ms']:10.2f} {row['floor_multiple']:8.2f} "
            f"{row['speedup_vs_allgather']:13.2f}x {peak} {sent}"
        )
    print("\n".join(lines), flush=True)


def table_rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """The step table's rows: each Newton–Schulz method's first muon_dist timing against the
    baseline and AdamW."""
    allgather, adamw = report["methods"][-2], report["methods"][-1]
    state = max(report["state_gib_per_rank"])
    rows = []
    for ns_method in report["options"]["ns_methods"]:
        muon = next(
            m
            for m in report["methods"]
            if m.get("ns_method") == ns_method and m.get("rule", "muon") == "muon"
        )
        peaks = [p for p in muon["peak_gib_per_rank"] if p is not None]
        rows.append(
            {
                "preset (layers)": f"{report['preset']} ({report['layers']})",
                "GPUs": str(report["world_size"]),
                "backend": report["options"]["backend"],
                "Newton–Schulz": ns_method,
                "muon_dist ms": f"{muon['median_ms']:.1f}",
                "× floor": f"{muon['floor_multiple']:.2f}",
                "floor ms": f"{report['floor_ms']:.1f}",
                "all-gather Muon": f"{allgather['median_ms'] / muon['median_ms']:.2f}× slower",
                "fused AdamW ms": f"{adamw['median_ms']:.1f}",
                "peak GiB (state)": f"{max(peaks):.2f} ({state:.2f})" if peaks else "—",
            }
        )
    return rows


def host_row(report: dict[str, Any], captured: dict[str, Any]) -> dict[str, str]:
    """The host-overhead table's row: the eager step against the captured one."""
    return {
        "preset (layers)": f"{report['preset']} ({report['layers']})",
        "GPUs": str(report["world_size"]),
        "backend": report["options"]["backend"],
        "eager ms": f"{report['methods'][0]['median_ms']:.2f}",
        "captured ms": f"{captured['median_ms']:.2f}",
    }


def default_json(preset: str) -> str:
    name = f"bench_step_{preset}.json"
    return os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    parser.add_argument("--layers", type=int, help="blocks (default: the preset's)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--replicate", type=int, default=1, help="R for an HSDP (R, W/R) mesh")
    parser.add_argument("--replica-mode", choices=REPLICA_MODES, default="split")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--comm-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--bucket-mb", type=float, default=128.0)
    parser.add_argument("--max-inflight", type=int, default=3)
    parser.add_argument(
        "--sweep-inflight", metavar="K,K,...", help="time muon_dist at each max_inflight listed"
    )
    parser.add_argument(
        "--ns-methods",
        default="auto,standard",
        help="comma-separated Newton–Schulz methods to time muon_dist with (auto, gram, "
        "standard); the first one is also checked against the all-gather baseline",
    )
    parser.add_argument(
        "--rules",
        default="muon",
        help="comma-separated update rules to time muon_dist under (muon, normuon, dion2); the "
        "parity check and the captured row run under muon",
    )
    parser.add_argument(
        "--no-cuda-graph", action="store_true", help="skip the captured muon_dist row on CUDA"
    )
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--coefficients", choices=sorted(COEFFICIENT_SETS), default="quintic")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method (>= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2)")
    parser.add_argument("--matmul-size", type=int, help="default 8192 on CUDA, 1024 on CPU")
    parser.add_argument(
        "--backward",
        action="store_true",
        help="time real training steps (forward, backward, step) of a model with the preset's "
        "blocks: muon_dist with and without overlap='backward', and AdamW (bench_backward.py)",
    )
    parser.add_argument(
        "--tokens", type=int, default=4096, help="tokens per rank and step with --backward"
    )
    parser.add_argument(
        "--dion",
        metavar="PATH",
        type=Path,
        help="also time microsoft/dion's Muon (Triton Newton–Schulz) on the same model and "
        "gradients: PATH is a folder holding its `dion` package (a checkout of the repository)",
    )
    parser.add_argument("--json", metavar="PATH", help="default $OUT/bench_step_<preset>.json")
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        type=Path,
        help="print (with --write-table: record) a finished run's --json again, no timing; "
        "say, on the machine that holds the repository",
    )
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args()
    if args.steps < 5 or args.warmup < 2:
        parser.error("use --steps >= 5 and --warmup >= 2: a median needs steps past compilation")
    args.layers = args.layers or PRESETS[args.preset].layers
    args.inflight = (
        [int(k) for k in args.sweep_inflight.split(",")]
        if args.sweep_inflight
        else [args.max_inflight]
    )
    args.rules = args.rules.split(",")
    for rule in args.rules:
        if rule not in RULES:
            parser.error(f"--rules: {rule!r} is not one of {list(RULES)}")
    args.ns_methods = args.ns_methods.split(",")
    for method in args.ns_methods:
        if method not in NS_METHODS:
            parser.error(f"--ns-methods: {method!r} is not one of {list(NS_METHODS)}")
    args.matmul_size = args.matmul_size or (8192 if args.device == "cuda" else 1024)
    args.json = args.json or default_json(args.preset + ("_backward" if args.backward else ""))
    return args


def init_distributed(args: argparse.Namespace) -> tuple[torch.device, DeviceMesh]:
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.replicate:
        raise ValueError(f"--replicate {args.replicate} does not divide the world size {world}")
    if args.replicate > 1:
        mesh = init_device_mesh(
            device.type,
            (args.replicate, world // args.replicate),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return device, mesh


@torch.no_grad()  # nothing here is differentiated; in-place writes to param shards need this
def run(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> int:
    world = dist.get_world_size()
    model = build_model(PRESETS[args.preset], args.layers, mesh, device)
    params: list[DTensor] = list(model.parameters())  # type: ignore[arg-type]
    set_random_grads(params)
    comm_dtype = torch.bfloat16 if args.comm_dtype == "bf16" else torch.float32
    groups = muon_dist.param_groups(model, lr=LR, weight_decay=WEIGHT_DECAY)
    if any(g["algorithm"] != "muon" for g in groups):
        raise RuntimeError("every preset parameter is a hidden matrix and must route to Muon")

    def make_muon(
        max_inflight: int, ns_method: str, cuda_graph: bool = False, rule: str = "muon"
    ) -> muon_dist.Muon:
        return muon_dist.Muon(
            groups,
            **MUON_RULE,
            ns_steps=args.ns_steps,
            coefficients=args.coefficients,
            backend=args.backend,
            ns_method=ns_method,
            comm_dtype=comm_dtype,
            bucket_bytes=int(args.bucket_mb * MIB),
            max_inflight=max_inflight,
            replica_mode=args.replica_mode,
            cuda_graph=cuda_graph,
            graph_warmup=1,
            rule=rule,
        )

    def make_baseline() -> AllGatherMuon:
        return AllGatherMuon(
            params,
            lr=LR,
            momentum=MOMENTUM,
            nesterov=True,
            weight_decay=WEIGHT_DECAY,
            ns_steps=args.ns_steps,
            coefficients=args.coefficients,
            backend=args.backend,
            comm_dtype=comm_dtype,
        )

    def make_adamw() -> torch.optim.AdamW:
        kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, **kernel)

    log("model ready; measuring the bf16 matmul rate")
    tflops = statistics.fmean(all_ranks(matmul_tflops(args.matmul_size, device)))
    flops, matrices = ns_flops(groups, args.ns_steps)
    floor_ms = flops / world / (tflops * 1e12) * 1e3
    # What the timing itself adds to every median: its syncs and barriers around no step.
    timing_ms = statistics.median(time_steps(lambda: None, args.warmup, args.steps, device)) * 1e3
    log("checking first-step parity of muon_dist and the all-gather baseline")
    first_method = args.ns_methods[0]
    parity = check_parity(
        params, lambda: make_muon(args.max_inflight, first_method), make_baseline, device
    )
    parity["ok"] = parity["update_rel"] <= PARITY_TOL

    methods = []
    for rule in args.rules:
        for ns_method in args.ns_methods:
            for k in args.inflight:
                log(f"timing muon_dist rule={rule} ns_method={ns_method} max_inflight={k}")
                prefix = "muon_dist" if rule == "muon" else f"muon_dist {rule}"
                name = f"{prefix} {ns_method} inflight={k}"
                make = functools.partial(make_muon, k, ns_method, rule=rule)
                row = time_method(name, make, args, device)
                methods.append({**row, "ns_method": ns_method, "rule": rule})
    if device.type == "cuda" and not args.no_cuda_graph:
        k, ns_method = args.inflight[0], args.ns_methods[0]
        log(f"timing muon_dist {ns_method} captured in a CUDA graph, max_inflight={k}")
        make = functools.partial(make_muon, k, ns_method, cuda_graph=True)
        name = f"muon_dist graph {ns_method} inflight={k}"
        methods.append({**time_method(name, make, args, device), "ns_method": ns_method})
    if args.dion is not None:
        log(f"timing microsoft/dion's Muon from {args.dion}")
        make = functools.partial(make_dion, args.dion, params, mesh)
        methods.append(time_method("dion muon triton", make, args, device, counted=False))
    log("timing the all-gather baseline")
    methods.append(time_method("allgather_muon", make_baseline, args, device, counted=False))
    log("timing AdamW")
    adamw_name = "adamw fused" if device.type == "cuda" else "adamw foreach"
    methods.append(time_method(adamw_name, make_adamw, args, device))
    baseline_ms = next(m["median_ms"] for m in methods if m["name"] == "allgather_muon")
    for row in methods:
        row["floor_multiple"] = row["median_ms"] / floor_ms
        row["speedup_vs_allgather"] = baseline_ms / row["median_ms"]

    state_bytes = 3 * sum(p.to_local().numel() * p.element_size() for p in params)
    report = {
        "preset": args.preset,
        "layers": args.layers,
        "params": sum(p.numel() for p in params),
        "muon_matrices": matrices,
        "world_size": world,
        "mesh_shape": list(mesh.shape),
        "mesh_names": list(mesh.mesh_dim_names or ()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "options": {
            key: getattr(args, key)
            for key in (
                "backend",
                "rules",
                "ns_methods",
                "comm_dtype",
                "bucket_mb",
                "inflight",
                "replicate",
                "replica_mode",
                "ns_steps",
                "coefficients",
                "steps",
                "warmup",
            )
        },
        "matmul_size": args.matmul_size,
        "matmul_tflops": tflops,
        "ns_flops": flops,
        "floor_ms": floor_ms,
        "timing_ms": timing_ms,
        "state_gib_per_rank": all_ranks(state_bytes / GIB),
        "parity": parity,
        "methods": methods,
    }
    report["wall_s"] = time.perf_counter() - START
    if dist.get_rank() == 0:
        report["run"] = tables.run_info(gpus=world)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json} ({report['wall_s']:.0f} s)")
        print_table(report)
        if args.write_table:
            record_tables(report)
    return 0 if parity["ok"] else 1


def record_tables(report: dict[str, Any]) -> None:
    """The report's rows of the step table and, where it timed a captured step, its row
    of the host table, under the run info it was measured with."""
    tables.record("step", table_rows(report), report["run"])
    captured = [m for m in report["methods"] if m["name"].startswith("muon_dist graph")]
    if captured:
        tables.record("host", [host_row(report, captured[0])], report["run"])


# What a report needs to be printed and recorded again (--from-json).
REPORT_KEYS = (
    "preset",
    "layers",
    "params",
    "muon_matrices",
    "world_size",
    "mesh_shape",
    "mesh_names",
    "device",
    "options",
    "matmul_size",
    "matmul_tflops",
    "ns_flops",
    "floor_ms",
    "state_gib_per_rank",
    "parity",
    "methods",
    "run",
)


def run_backward_mode(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> int:
    """``--backward``: training steps with and without overlap (:mod:`bench_backward`)."""
    options = {
        "backend": args.backend,
        "ns_steps": args.ns_steps,
        "coefficients": args.coefficients,
        "ns_method": args.ns_methods[0],
        "comm_dtype": torch.bfloat16 if args.comm_dtype == "bf16" else torch.float32,
        "bucket_bytes": int(args.bucket_mb * MIB),
        "max_inflight": args.max_inflight,
        "replica_mode": args.replica_mode,
    }
    log(f"timing training steps, {args.layers} {args.preset} blocks, {args.tokens} tokens/rank")
    report = bench_backward.run_backward(args, PRESETS[args.preset].block, device, mesh, options)
    report.update(
        preset=args.preset,
        layers=args.layers,
        world_size=dist.get_world_size(),
        mesh_shape=list(mesh.shape),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        options={**{k: str(v) for k, v in options.items()}, "steps": args.steps},
        wall_s=time.perf_counter() - START,
    )
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json} ({report['wall_s']:.0f} s)")
        print(bench_backward.format_rows(report))
    return 0


def main() -> int:
    args = parse_args()
    if args.from_json is not None:
        report = tables.read_results(args.from_json, "bench_step.py", REPORT_KEYS)
        print_table(report)
        if args.write_table:
            record_tables(report)
        return 0
    device, mesh = init_distributed(args)
    try:
        if args.backward:
            return run_backward_mode(args, device, mesh)
        return run(args, device, mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
