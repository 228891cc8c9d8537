"""Where one muon_dist optimizer step spends its GPU time (torch.profiler), per kernel.

    torchrun --standalone --nproc-per-node 2 tools/profile_step.py --preset llama8b --layers 8

Builds the same FSDP2 model as benchmarks/bench_step.py, takes warm-up steps, profiles two
steps and prints rank 0's kernels by total device time, with the step's wall time. With
``--host`` it profiles rank 0's Python instead (cProfile, by own time), to tell whether the
step is bound by the host launching its kernels. benchmarks/profile_step.py splits each
rank's step into Newton–Schulz, other compute, exposed communication and idle time instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_step import PRESETS, build_model, init_distributed, set_random_grads

import muon_dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25, help="kernels to print")
    parser.add_argument(
        "--trace-dir", type=Path, help="write each rank's Chrome trace here (trace_rank<r>.json)"
    )
    parser.add_argument("--host", action="store_true", help="profile rank 0's Python instead")
    args = parser.parse_args()
    for flag in ("layers", "rows", "replicate"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    device, mesh = init_distributed(args)
    with torch.no_grad():
        model = build_model(PRESETS[args.preset], args.layers, mesh, device)
        params = list(model.parameters())
        set_random_grads(params)  # type: ignore[arg-type]
        opt = muon_dist.Muon(muon_dist.param_groups(model), backend=args.backend)
        for _ in range(2):
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if args.host:
            profile_host(opt, device, args.rows)
            dist.destroy_process_group()
            return
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(2):
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 2
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.trace_dir / f"trace_rank{dist.get_rank()}.json"))
    if dist.get_rank() == 0:
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(
            prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60)
        )
        print(
            f"{args.preset} x{args.layers}, {dist.get_world_size()} ranks: "
            f"{wall * 1e3:.1f} ms per step"
        )
    dist.destroy_process_group()


def profile_host(opt: torch.optim.Optimizer, device: torch.device, rows: int) -> None:
    """cProfile two steps on rank 0; the other ranks step alongside, unprofiled."""
    host = cProfile.Profile() if dist.get_rank() == 0 else None
    start = time.perf_counter()
    if host is not None:
        host.enable()
    for _ in range(2):
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if host is not None:
        host.disable()
        wall = (time.perf_counter() - start) / 2
        print(f"host profile, rank 0: {wall * 1e3:.1f} ms per step (profiled)")
        pstats.Stats(host).sort_stats("tottime").print_stats(rows)


if __name__ == "__main__":
    main()
