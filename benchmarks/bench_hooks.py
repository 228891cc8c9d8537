"""Host time of ``overlap="backward"``'s gradient hooks, on CPU.

    python3 benchmarks/bench_hooks.py
    python3 benchmarks/bench_hooks.py --layers 64 --per-bucket 8 --steps 30

One gloo rank, in process: an FSDP2 model of ``--layers`` tiny square linear layers (each
its own unit, so each gradient gets its own hook), with ``bucket_bytes`` set so that about
``--per-bucket`` matrices share a bucket; most hooks then start no bucket and every
``--per-bucket``-th starts one. It trains with ``Muon(..., overlap="backward")`` and times
each call of :meth:`BackwardStart.report` (the hook's work in the optimizer) and of the
whole hook (``Muon._grad_ready``: also the gradient's check and unwrapping), split by
whether the call started a bucket; the mean and median microseconds of each go to
stdout, with the cost of an empty ``record_function`` range while no profiler runs. The
times are the thread's CPU time, not wall time, so that other processes sharing the cores
do not count.

The tensors are tiny so the hook's own host work dominates; on CUDA each device launch or
stream call the hook makes costs more than on CPU, so the gap there is wider. To time
another version of the package, put its checkout first: ``PYTHONPATH=<checkout> python3
benchmarks/bench_hooks.py`` (run from this checkout, for the script).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import muon_dist
from muon_dist.step.launch.backward import BackwardStart

Timings = dict[str, dict[bool, list[float]]]  # per timed function, per "started a bucket"


def build(layers: int, dim: int) -> nn.Module:
    """Square linear layers, each its own FSDP2 unit, so each gradient has its own hook."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextmanager
def timing(
    owner: type, name: str, early: Callable[[Any], BackwardStart | None], into: Timings
) -> Iterator[None]:
    """Time each call of ``owner.name``, filed by whether the call started a bucket."""
    original = getattr(owner, name)
    calls = into.setdefault(name, {False: [], True: []})

    def timed(self: Any, *args: Any) -> None:
        start = early(self)
        before = 0 if start is None else start.started
        begin = time.thread_time_ns()
        original(self, *args)
        elapsed = (time.thread_time_ns() - begin) / 1e3
        calls[start is not None and start.started > before].append(elapsed)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def time_hooks(args: argparse.Namespace) -> Timings:
    """Train ``args.warmup`` steps, then time the hooks of ``args.steps`` more."""
    model = build(args.layers, args.dim)
    timings: Timings = {}

    def runner_early(opt: muon_dist.Muon) -> BackwardStart | None:
        return opt.runner.early

    # Muon binds its hook method when built: patch the class first.
    with (
        timing(BackwardStart, "report", lambda start: start, timings),
        timing(muon_dist.Muon, "_grad_ready", runner_early, timings),
    ):
        opt = muon_dist.Muon(
            model.parameters(),
            overlap="backward",
            comm_dtype=torch.float32,
            ns_dtype=torch.float32,
            bucket_bytes=args.per_bucket * args.dim * args.dim * 4,
        )
        inputs = torch.randn(4, args.dim, generator=torch.Generator().manual_seed(1))
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                for calls in timings.values():
                    calls[False].clear()
                    calls[True].clear()
            opt.zero_grad()
            model(inputs).square().mean().backward()
            opt.step()
    return timings


def record_function_us(calls: int = 100_000) -> float:
    """Mean µs of an empty ``record_function`` range while no profiler runs."""
    begin = time.thread_time_ns()
    for _ in range(calls):
        with torch.profiler.record_function("muon_dist.grad_hook"):
            pass
    return (time.thread_time_ns() - begin) / 1e3 / calls


def report(timings: Timings, empty_range_us: float) -> str:
    lines = [
        "| timed | hooks that start no bucket: n, mean µs, median µs "
        "| hooks that start one or more: n, mean µs, median µs |",
        "| --- | --- | --- |",
    ]
    for name, calls in timings.items():
        cells = []
        for started in (False, True):
            us = calls[started]
            cells.append(
                f"{len(us)}, {statistics.mean(us):.1f}, {statistics.median(us):.1f}" if us else "-"
            )
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    lines.append(f"\nempty record_function range, no profiler: {empty_range_us:.2f} µs")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--per-bucket", type=int, default=8, help="matrices per bucket, about")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            timings = time_hooks(args)
        finally:
            dist.destroy_process_group()
    print(report(timings, record_function_us()))


if __name__ == "__main__":
    main()
