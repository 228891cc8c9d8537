"""Where the time of a training step goes, plain and with ``overlap="backward"``: a profile.

    torchrun --standalone --nproc-per-node 1 benchmarks/profile_overlap.py --out prof -- \\
        --dim 2048 --layers 20 --heads 16 --vocab 8192 --seq-len 1024 --batch-size 16

Builds the example's model and Muon (examples/train.py, its flags after ``--``), trains
``--warmup`` steps on random tokens, then profiles ``--steps`` steps with
``torch.profiler`` (CPU and CUDA), once per mode in the same process. From each trace
(``trace_<mode>.json``, Chrome format) it measures, per step, on rank 0:

- the GPU span (first kernel start to last kernel end, over the steps) and the time no
  kernel ran on any stream (the device idle);
- kernel time on the stream that runs forward and backward, and on every other stream (the
  Muon phase's side stream, NCCL's), and how much of the side streams' time ran while a
  kernel of the main stream did (the Newton-Schulz work hidden beside backward);
- host time inside the overlap's gradient hooks (``muon_dist.grad_hook`` ranges).

The table goes to stdout and ``--out/profile.md``; ``analyze`` is pure and tested on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train  # noqa: E402  (the example, from its folder)

HOOK = "muon_dist.grad_hook"
MODES = ("none", "backward")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end)."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def intersection_length(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> float:
    """Length covered by both unions: |A| + |B| - |A or B|."""
    return union_length(a) + union_length(b) - union_length([*a, *b])


def analyze(trace: dict[str, Any], steps: int) -> dict[str, float]:
    """Per-step milliseconds of one profile (see the module docstring)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for e in kernels:
        by_stream.setdefault(int(e["args"]["stream"]), []).append((e["ts"], e["ts"] + e["dur"]))
    hooks = [
        e["dur"]
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "user_annotation" and e.get("name") == HOOK
    ]
    out = {"hook host ms": sum(hooks) / 1e3 / steps, "hooks per step": len(hooks) / steps}
    if not by_stream:
        return out
    busy = {s: sum(b - a for a, b in iv) for s, iv in by_stream.items()}
    main = max(busy, key=lambda s: busy[s])
    side = [iv for s, ivs in by_stream.items() if s != main for iv in ivs]
    everything = [iv for ivs in by_stream.values() for iv in ivs]
    span = max(b for _, b in everything) - min(a for a, _ in everything)
    out.update(
        {
            "GPU span ms": span / 1e3 / steps,
            "idle ms": (span - union_length(everything)) / 1e3 / steps,
            "main stream ms": union_length(by_stream[main]) / 1e3 / steps,
            "other streams ms": union_length(side) / 1e3 / steps,
            "beside main ms": intersection_length(by_stream[main], side) / 1e3 / steps,
        }
    )
    return out


def profile_mode(
    mode: str, args: argparse.Namespace, flags: list[str], env: train.Env
) -> dict[str, Any]:
    """Train ``args.warmup`` steps in ``mode``, then profile ``args.steps`` more."""
    run = train.parse_args([*flags, "--overlap", mode])
    mesh = train.build_mesh(env, run.replicate)
    model = train.build_model(run, mesh, env)
    opt = train.build_optimizer("muon", model, run)
    rows = train.rank_slice(run.batch_size, env.rank, env.world_size)
    tokens = run.batch_size * run.seq_len
    generator = torch.Generator().manual_seed(0)
    local = rows.stop - rows.start

    def one_step() -> None:
        batch = torch.randint(0, run.vocab, (local, run.seq_len + 1), generator=generator)
        batch = batch.to(env.device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        (loss * (env.world_size / tokens)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        one_step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(env.device)
    dist.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            one_step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
    path = args.out / f"trace_{mode}_rank{env.rank}.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    if env.rank != 0:
        path.unlink()
    return analyze(trace, args.steps)


def table(results: dict[str, dict[str, float]]) -> str:
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    lines = ["| mode | " + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
    for mode, r in results.items():
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in keys]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/profile_overlap"))
    p.add_argument("--warmup", type=int, default=6, help="steps before each profile")
    p.add_argument("--steps", type=int, default=4, help="steps profiled per mode")
    args = p.parse_args(argv[:split])
    flags = argv[split + 1 :]
    args.out.mkdir(parents=True, exist_ok=True)
    env = train.init_distributed()
    try:
        results = {}
        for mode in MODES:
            results[mode] = profile_mode(mode, args, flags, env)
            gc.collect()  # the mode's model and optimizer, before the next mode builds its own
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    if env.rank == 0:
        text = table(results) + "\n"
        (args.out / "profile.md").write_text(text)
        print(text, end="")


if __name__ == "__main__":
    main()
