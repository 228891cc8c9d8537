"""The GPU time of a captured step with a bucket's launch-bound stacks on 1, 2 or 4 lanes.

A captured step runs the launch-bound stacks of each bucket on parallel streams
(:data:`muon_dist.step.bucket.orthogonalizer.LANES`). This times the captured graph alone:
its replays back to back between two CUDA events, so the host's own time, which varies by
up to 2x from process to process on a shared machine, stays out. Every lane count is
measured in each of ``--repeats`` rounds, interleaved, on bench_step.py's FSDP2 model
(random gradients, its Muon options); each cell is the slowest rank's median over the
rounds (min–max), with its peak memory.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_lanes.py --preset small224
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys

import bench_step
import torch
import torch.distributed as dist

import muon_dist
from muon_dist.step.bucket import orthogonalizer

GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small224", choices=sorted(bench_step.PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2, orthogonalizer.LANES])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args()
    if any(count < 1 for count in args.lanes):
        parser.error(f"--lanes {args.lanes}: each lane count must be at least 1")
    for flag in ("repeats", "replays"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be at least 1")
    return args


def graph_ms(opt: muon_dist.Muon, replays: int) -> float:
    """The captured step's graph replayed ``replays`` times back to back: GPU ms each."""
    graph = opt.runner.graph
    if graph is None or graph._graph is None:
        raise RuntimeError("the step was not captured; bench_lanes.py times captured steps")
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph._graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / replays


def slowest(value: float) -> float:
    """The largest ``value`` over the ranks."""
    cell = torch.tensor([value], device="cuda")
    dist.all_reduce(cell, op=dist.ReduceOp.MAX)
    return float(cell.item())


@torch.no_grad()  # in-place writes to parameter shards need it; nothing is differentiated
def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_lanes.py: captured steps need a CUDA device; none here", file=sys.stderr)
        return 1
    device, mesh = bench_step.init_distributed(argparse.Namespace(device="cuda", replicate=1))
    preset = bench_step.PRESETS[args.preset]
    model = bench_step.build_model(preset, args.layers or preset.layers, mesh, device)
    params = list(model.parameters())
    bench_step.set_random_grads(params)  # type: ignore[arg-type]
    groups = muon_dist.param_groups(model, lr=bench_step.LR, weight_decay=bench_step.WEIGHT_DECAY)
    lanes = orthogonalizer.lanes
    times: dict[int, list[float]] = {count: [] for count in args.lanes}
    peaks: dict[int, float] = {}
    try:
        for _ in range(args.repeats):
            for count in args.lanes:
                orthogonalizer.lanes = functools.partial(lanes, count=count)  # type: ignore[assignment]
                gc.collect()  # the last round's optimizer and its graph's memory pool
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                opt = muon_dist.Muon(
                    groups, **bench_step.MUON_RULE, cuda_graph=True, graph_warmup=1
                )
                for _ in range(3):  # warm-up, capture, one replay
                    opt.step()
                times[count].append(slowest(graph_ms(opt, args.replays)))
                peaks[count] = slowest(torch.cuda.max_memory_allocated(device) / GIB)
                del opt
    finally:
        orthogonalizer.lanes = lanes
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name(device)
        print(
            f"{args.preset}, {dist.get_world_size()}× {gpu}, torch {torch.__version__}: "
            f"captured step's graph, GPU ms a replay ({args.replays} back to back)"
        )
        print("| lanes | graph GPU ms | peak GiB |\n| --- | --- | --- |")
        for count, values in times.items():
            median = statistics.median(values)
            print(
                f"| {count} | {median:.3f} ({min(values):.3f}–{max(values):.3f}) "
                f"| {peaks[count]:.2f} |"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
