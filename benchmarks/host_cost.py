"""The host's cost of a steady-state eager Muon step, measured on CPU: operations dispatched,
Python calls and host time per step, per Muon matrix and per bucket.

    torchrun --standalone --nproc-per-node 2 benchmarks/host_cost.py --model qwen3-dense
    python benchmarks/host_cost.py --scale 64 --sites 20   # one process: no exchange

The model is bench_hf.py's (transformers' own code, FSDP2 with its bf16 mixed-precision
policy, ``muon_dist.param_groups``, ``Muon(groups, lr=0.02, adamw_lr=3e-4,
weight_decay=0.1)``, eager) with its layers and heads, so the same number and kind of
matrices, but every width divided by ``--scale`` and the bucket budget by its square, so the
plan has the same buckets. The arithmetic is then negligible: what a step costs is the
host's. Gradients are fresh tensors every step, as ``zero_grad()`` (``set_to_none``) and
backward leave them (``--keep-grads``: one set, kept). Newton–Schulz is replaced by what its
CUDA-graph replay costs the host (copy in, replay, copy out: two copies here) unless
``--real-ns``: on CPU its torch iteration would run dozens of operations per stack that
a GPU runs as one graph or, on larger stacks, as its own kernels; either way it is not
the cost around it.

Per step, after ``--warmup`` steps: the operations that reach the dispatcher (one step;
views, allocations and the rest, which on CUDA are mostly kernel launches), by the
innermost ``muon_dist`` function that issued them (``--sites``); the Python calls
(cProfile, one step; ``--functions`` by own time); host time, wall and the stepping
thread's CPU time, over ``--steps`` steps, the slowest rank's median (min–max).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from bench_hf import MODELS, ModelSpec, build_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import muon_dist

WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim")
PACKAGE = Path(muon_dist.__file__).resolve().parent


def scaled(spec: ModelSpec, scale: int) -> ModelSpec:
    """``spec`` with every width divided by ``scale``: the same layers, heads and matrices."""
    full = {k: v // scale if k in WIDTHS else v for k, v in spec.full.items()}
    return dataclasses.replace(spec, full=full)


def _stand_in_ns(x: torch.Tensor, *args: Any, dtype: torch.dtype, **kwargs: Any) -> torch.Tensor:
    """What a CUDA-graph replay of Newton–Schulz costs the host: a copy in, a copy out."""
    return x.to(dtype, copy=True).clone()


class SiteCount(TorchDispatchMode):
    """Operations dispatched, by kind and by the innermost ``muon_dist`` function (file:name)
    on the Python stack that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        kind = "view" if func.is_view else "alloc" if name.startswith("empty") else "other"
        self.kinds[kind] += 1
        self.names[name] += 1
        self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            return f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside muon_dist>"


class Grads:
    """Gradients like the parameters': two sets of random local shards, handed out in turn
    as new DTensors (a fresh tensor every step, as FSDP2's backward leaves them: wrapped in
    the parameter's own sharding spec), or, where ``kept``, one set given once and kept."""

    def __init__(self, params: Sequence[DTensor], kept: bool) -> None:
        self.params, self.kept = list(params), kept
        gen = torch.Generator().manual_seed(0)
        self.locals = [
            [torch.randn(p.to_local().shape, generator=gen) for p in self.params]
            for _ in range(1 if kept else 2)
        ]
        self.turn = 0

    def give(self) -> None:
        if self.kept and self.turn:
            return
        locals_ = self.locals[self.turn % len(self.locals)]
        self.turn += 1
        for p, local in zip(self.params, locals_, strict=True):
            # As FSDP2's backward wraps a reduced gradient: in its parameter's own spec.
            p.grad = DTensor(local, p._spec, requires_grad=False)


def build(args: argparse.Namespace) -> tuple[nn.Module, muon_dist.Muon, Grads]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(scaled(MODELS[args.model], args.scale), False, torch.device("cpu"), mesh)
    opt = muon_dist.Muon(
        muon_dist.param_groups(model),
        lr=0.02,
        adamw_lr=3e-4,
        weight_decay=0.1,
        bucket_bytes=max(1, (128 << 20) // args.scale**2),
    )
    grads = Grads(list(model.parameters()), args.keep_grads)  # type: ignore[arg-type]
    return model, opt, grads


def one_step(opt: muon_dist.Muon, grads: Grads) -> None:
    grads.give()
    opt.step()


def count_ops(opt: muon_dist.Muon, grads: Grads) -> SiteCount:
    counter = SiteCount()
    grads.give()
    with counter:
        opt.step()
    return counter


def python_calls(opt: muon_dist.Muon, grads: Grads) -> pstats.Stats:
    grads.give()
    profiler = cProfile.Profile()
    profiler.enable()
    opt.step()
    profiler.disable()
    return pstats.Stats(profiler)


class Collectives:
    """The stepping thread's CPU time inside collectives (issue and wait): gloo spins while
    a peer lags, which is no host cost of the step's own."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
            return _TimedWork(result, self) if result is not None else None

        return run


class _TimedWork:
    def __init__(self, work: Any, clock: Collectives) -> None:
        self.work, self.clock = work, clock

    def wait(self) -> Any:
        start = time.thread_time()
        try:
            return self.work.wait()
        finally:
            self.clock.seconds += time.thread_time() - start


def host_times(opt: muon_dist.Muon, grads: Grads, steps: int) -> dict[str, list[float]]:
    """Per step, ms: wall time, the stepping thread's CPU time, and that CPU time outside
    collectives."""
    clock = Collectives()
    times: dict[str, list[float]] = {"wall": [], "cpu": [], "host": []}
    patches = [
        mock.patch.object(dist, name, clock.timed(getattr(dist, name)))
        for name in ("all_to_all_single", "all_reduce")
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        for _ in range(steps):
            grads.give()
            dist.barrier()
            wall, cpu, clock.seconds = time.perf_counter(), time.thread_time(), 0.0
            opt.step()
            times["cpu"].append((time.thread_time() - cpu) * 1e3)
            times["wall"].append((time.perf_counter() - wall) * 1e3)
            times["host"].append(times["cpu"][-1] - clock.seconds * 1e3)
    return times


def _slowest(values: list[float]) -> list[float]:
    """The slowest rank's per-step values (by median)."""
    everyone: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    return max((v for v in everyone if v is not None), key=statistics.median)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of this rank (times: the slowest rank's)."""
    _, opt, grads = build(args)
    for _ in range(args.warmup):
        one_step(opt, grads)
    ops = count_ops(opt, grads)
    stats = python_calls(opt, grads)
    times = host_times(opt, grads, args.steps)
    muon = opt.runner.muon
    assert muon is not None, "the model has Muon matrices"
    return {
        "matrices": len(muon.tensors.entries),
        "buckets": len(muon.plan.buckets),
        "ops": ops,
        "calls": stats.total_calls,  # type: ignore[attr-defined]
        "stats": stats,
        **{key: _slowest(values) for key, values in times.items()},
    }


def report(found: dict[str, Any], args: argparse.Namespace) -> str:
    matrices, buckets, ops = found["matrices"], found["buckets"], found["ops"]
    total = sum(ops.kinds.values())
    per = f"{matrices} Muon matrices, {buckets} buckets"
    lines = [
        f"{args.model} / {args.scale} on {dist.get_world_size()} ranks: {per}",
        f"ops/step {total} ({', '.join(f'{k} {n}' for k, n in ops.kinds.most_common())}); "
        f"per matrix {total / matrices:.1f}, per bucket {total / buckets:.1f}",
        f"python calls/step {found['calls']}; per matrix {found['calls'] / matrices:.1f}",
        f"host ms/step {_spread(found['host'])} outside collectives; cpu "
        f"{_spread(found['cpu'])}, wall {_spread(found['wall'])} "
        f"(slowest rank, {args.steps} steps)",
    ]
    if args.sites:
        lines.append("ops by muon_dist function:")
        lines += [f"  {n:6d}  {site}" for site, n in ops.sites.most_common(args.sites)]
        lines.append("ops by name:")
        lines += [f"  {n:6d}  {name}" for name, n in ops.names.most_common(args.sites)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-dense")
    p.add_argument("--scale", type=int, default=8, help="divide every width by this")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--keep-grads", action="store_true", help="one set of gradients, kept")
    p.add_argument("--real-ns", action="store_true", help="run Newton–Schulz itself")
    p.add_argument("--sites", type=int, default=0, help="print this many busiest op sites")
    p.add_argument("--functions", type=int, default=0, help="print this many functions")
    p.add_argument("--sort", default="tottime", help="the functions by this pstats key")
    args = p.parse_args(argv)
    for flag in ("scale", "warmup", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # one process without torchrun
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    patch = mock.patch("muon_dist.step.bucket.orthogonalizer.newton_schulz", _stand_in_ns)
    with torch.no_grad(), contextlib.nullcontext() if args.real_ns else patch:
        found = measure(args)
    if dist.get_rank() == 0:
        print(report(found, args), flush=True)
        if args.functions:
            found["stats"].sort_stats(args.sort).print_stats(args.functions)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
