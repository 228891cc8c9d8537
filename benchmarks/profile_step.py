"""A per-step profile that adds up: where a muon_dist step's wall time goes, per rank.

    torchrun --standalone --nproc-per-node 4 benchmarks/profile_step.py --preset llama8b \\
        --layers 32 --out $OUT
    torchrun --standalone --nproc-per-node 4 benchmarks/profile_step.py --train --out $OUT -- \\
        --dim 2048 --layers 20 --heads 16 --vocab 8192 --seq-len 1024 --batch-size 64
    python benchmarks/profile_step.py --from-json $OUT/profile_step_*.json   # the table again

``--preset`` profiles the optimizer step alone on benchmarks/bench_step.py's FSDP2 model
(random gradients, its Muon options); ``--train`` a whole training step of
examples/train.py's model (its flags after ``--``, random tokens), forward and backward
included, and its optimizer part on its own. Each step runs after a device sync and a
barrier and ends with a device sync, as bench_step.py times it, inside a host range that
is its window. From every rank's Chrome trace, per step (milliseconds):

- ``wall``: the window; it splits exactly into ``ns busy`` (time a Newton–Schulz kernel
  ran), ``other compute`` (another non-communication kernel ran, none of Newton–Schulz),
  ``exposed comm`` (only communication kernels ran: NCCL not hidden by compute on the same
  device) and ``idle`` (no kernel ran);
- ``ns sum``: the summed durations of the Newton–Schulz kernels. They are the kernels
  launched inside a ``muon_dist.newton_schulz`` range where the trace has one; otherwise the
  matrix-product kernels (tools/trace_summary.py's "gemm" class, the Triton symmetric
  products among them) launched from the optimizer's step or its gradient hooks, which
  leaves out Newton–Schulz's few elementwise kernels;
- ``host``: from the window's start to the end of its last launch call (the time the host
  took to queue the step) and ``launch``: the summed durations of the launch calls.

Every rank writes its summary beside its trace; rank 0 gathers them and reports, per step,
the slowest rank's wall and breakdown and the largest per-rank NS sum (medians over the
steps). The owner imbalance (max/mean of the ranks' Newton–Schulz FLOPs) and the bucket
imbalance (sum over buckets of the busiest owner's FLOPs over the sum of the mean) come from
the plan alone (:func:`plan_flops`), counted as the dispatcher runs it: the Gram iteration
where it picks Gram. Under Dion2 (``--rule dion2``) the plan cannot know the slices a step
chooses, and the table gives no rate and no imbalance. A CPU run has no device kernels:
it reports the wall and says so.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tools"))
import bench_step  # noqa: E402  (benchmarks/, this script's folder)
import tables  # noqa: E402  (benchmarks/)
import trace_summary  # noqa: E402  (tools/: kernel classes and interval arithmetic)
import train  # noqa: E402  (the example, from its folder)

import muon_dist  # noqa: E402
from muon_dist.kernels.dispatch import prefer_gram  # noqa: E402
from muon_dist.kernels.gram import DEFAULT_RESTARTS, segments  # noqa: E402
from muon_dist.options.schema import MUON_OPTIONS  # noqa: E402
from muon_dist.plan.build import build_plan, ns_cost, placement_of  # noqa: E402
from muon_dist.plan.views import matrix_views  # noqa: E402
from muon_dist.rules.registry import RULES, rule_of  # noqa: E402

Interval = tuple[float, float]

STEP_RANGE = "muon_dist.profile.step"
OPTIMIZER_RANGE = "muon_dist.profile.optimizer"
PHASES = {"step": STEP_RANGE, "optimizer": OPTIMIZER_RANGE}
REPORT_KEYS = ("name", "world_size", "plan", "phases")  # what --from-json reads of a report
# The range a labelled Newton–Schulz call would open (see the module docstring); without it,
# matrix products launched inside these ranges count as Newton–Schulz.
NS_RANGE = "muon_dist.newton_schulz"
NS_CALLERS = ("Optimizer.step#", "muon_dist.grad_hook")
# Kernels only Newton–Schulz launches (kernels/triton_ns.py), counted wherever launched, also
# where the trace lacks their launch call.
NS_ONLY_KERNELS = ("_sym_product_kernel",)
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Per-step keys that add up to the wall, and the others, in table order.
PARTS = ("ns_busy", "other_compute", "exposed_comm", "idle")
DEVICE_KEYS = ("ns_sum", *PARTS, "comm", "host", "launch", "launches", "kernels")


# ---------------------------------------------------------------------------------------
# Trace arithmetic (pure; tests/tooling/test_profile_step.py checks it on a hand-made trace)


class Ranges:
    """The merged host intervals of some annotation ranges: is a time inside one?"""

    def __init__(self, intervals: Sequence[Interval]) -> None:
        merged = trace_summary.union(list(intervals))
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self._starts, t) - 1
        return i >= 0 and t <= self._ends[i]


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def _clip(spans: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def _counts_as_ns(kind: str, labelled: bool) -> bool:
    """Whether a kernel of class ``kind`` launched from Newton–Schulz's caller is part of it:
    under a label every kernel but communication, else only matrix products."""
    return kind != "nccl" if labelled else kind == "gemm"


class StepTrace:
    """One rank's trace, indexed for :meth:`window`: its GPU events, the host calls that
    launched them (by correlation id) and its annotation ranges by name."""

    def __init__(self, trace: dict[str, Any]) -> None:
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
        self.gpu = [e for e in events if e.get("cat") in trace_summary.GPU_CATEGORIES]
        annotations = [e for e in events if e.get("cat") == "user_annotation"]
        self.ranges: dict[str, list[Interval]] = defaultdict(list)
        for e in annotations:
            self.ranges[e["name"]].append(_span(e))
        launched = {e.get("args", {}).get("correlation") for e in self.gpu} - {None}
        self.launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") in HOST_CATEGORIES and e.get("args", {}).get("correlation") in launched
        }
        # Newton–Schulz's callers, per host thread: a launch counts only inside a range of
        # its own thread (backward's thread launches while the main thread waits in one).
        labelled = any(e["name"] == NS_RANGE for e in annotations)
        self.ns_source = "annotation" if labelled else "matrix products in the optimizer"
        by_thread: dict[Any, list[Interval]] = defaultdict(list)
        for e in annotations:
            if e["name"] == NS_RANGE if labelled else e["name"].startswith(NS_CALLERS):
                by_thread[e.get("tid")].append(_span(e))
        callers = {tid: Ranges(spans) for tid, spans in by_thread.items()}

        def launched_by_caller(e: dict[str, Any]) -> bool:
            launch = self.launches.get(e.get("args", {}).get("correlation"))
            if launch is None or launch.get("tid") not in callers:
                return False
            return float(launch["ts"]) in callers[launch.get("tid")]

        # By event, not by correlation id: a CUDA graph's kernels share their launch's id.
        self._ns = {
            id(e)
            for e in self.gpu
            if e["name"].startswith(NS_ONLY_KERNELS)
            or (
                _counts_as_ns(trace_summary.category(e["name"]), labelled) and launched_by_caller(e)
            )
        }

    def is_ns(self, e: dict[str, Any]) -> bool:
        return id(e) in self._ns

    def window(self, lo: float, hi: float) -> dict[str, Any]:
        """Milliseconds of one step whose host window is ``[lo, hi]`` (see the docstring)."""
        out: dict[str, Any] = {"wall": (hi - lo) / 1e3}
        inside = [e for e in self.gpu if _clip([_span(e)], lo, hi)]
        if not inside:
            out.update(dict.fromkeys(DEVICE_KEYS), ns_source=None)
            return out
        spans = {id(e): _clip([_span(e)], lo, hi)[0] for e in inside}
        comm = [spans[id(e)] for e in inside if trace_summary.category(e["name"]) == "nccl"]
        compute = [spans[id(e)] for e in inside if trace_summary.category(e["name"]) != "nccl"]
        ns = [spans[id(e)] for e in inside if self.is_ns(e)]
        busy = trace_summary.total(trace_summary.union(comm + compute))
        compute_busy = trace_summary.total(trace_summary.union(compute))
        ns_busy = trace_summary.total(trace_summary.union(ns))
        calls = [
            self.launches[c]
            for c in {e.get("args", {}).get("correlation") for e in inside}
            if c in self.launches and lo <= float(self.launches[c]["ts"]) <= hi
        ]
        out.update(
            ns_sum=sum(b - a for a, b in ns) / 1e3,
            ns_busy=ns_busy / 1e3,
            other_compute=(compute_busy - ns_busy) / 1e3,
            exposed_comm=(busy - compute_busy) / 1e3,
            idle=(hi - lo - busy) / 1e3,
            comm=trace_summary.total(trace_summary.union(comm)) / 1e3,
            host=(max((_span(c)[1] for c in calls), default=lo) - lo) / 1e3,
            launch=sum(float(c.get("dur", 0.0)) for c in calls) / 1e3,
            launches=len(calls),
            kernels=len(inside),
            ns_source=self.ns_source,
        )
        return out

    def steps(self, range_name: str) -> list[dict[str, Any]]:
        """Per occurrence of ``range_name``, in time order, its step's milliseconds."""
        return [self.window(lo, hi) for lo, hi in sorted(self.ranges.get(range_name, []))]


def combine(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Every rank's steps of one phase as the report's numbers.

    Per step: the slowest rank's (largest wall) breakdown and the largest NS sum of any
    rank; then the median over steps of each. ``per_rank`` holds each rank's medians.
    """
    count = min(len(steps) for steps in per_rank)
    ranks, slowest = [], []
    for s in range(count):
        rank = max(range(len(per_rank)), key=lambda r: per_rank[r][s]["wall"])
        sums = [steps[s]["ns_sum"] for steps in per_rank if steps[s]["ns_sum"] is not None]
        ranks.append(rank)
        slowest.append({**per_rank[rank][s], "ns_sum_max": max(sums) if sums else None})
    return {
        "steps": count,
        "slowest_ranks": ranks,
        "slowest": _medians(slowest),
        "per_rank": [_medians(steps[:count]) for steps in per_rank],
    }


def _medians(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over ``rows``; a key holding a label or None takes the first row's."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        numbers = [v for v in values if isinstance(v, int | float)]
        out[key] = statistics.median(numbers) if len(numbers) == len(values) else values[0]
    return out


# ---------------------------------------------------------------------------------------
# The plan's Newton–Schulz work per rank (pure: no process group, no profile)


def dispatched_flops(
    rows: int, cols: int, steps: int, gram: bool, restarts: Sequence[int] = DEFAULT_RESTARTS
) -> float:
    """Dense-equivalent FLOPs of one matrix's Newton–Schulz as the kernels run it.

    Standard: :func:`muon_dist.plan.build.ns_cost`. Gram (m ≤ n): per segment between
    restarts of L steps, the Gram matrix and the closing ``Q·X`` (2m²n each) and per step the
    m×m products: P (2m³), and after a segment's first step Q ← P·Q (2m³), and before its
    last R ← P·R·P (4m³).
    """
    if not gram:
        return ns_cost(rows, cols, steps)
    m, n = min(rows, cols), max(rows, cols)
    total = 0.0
    for segment in segments(steps, tuple(restarts)):
        length = len(segment)
        total += 4.0 * m * m * n + (8.0 * length - 6.0) * m**3
    return total


def takes_gram(method: str, rows: int, cols: int, cuda: bool) -> bool:
    """Whether the dispatcher runs the Gram iteration (kernels/dispatch.py's rule)."""
    return method == "gram" or (method == "auto" and cuda and prefer_gram(rows, cols))


def imbalance(loads: Sequence[float]) -> float | None:
    """max/mean of per-rank loads (None when there is no work)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else None


def plan_flops(
    groups: Sequence[dict[str, Any]],
    world: int,
    cuda: bool,
    *,
    bucket_bytes: int,
    itemsize: int,
    replica_mode: str = "split",
    backward_order: bool = False,
) -> dict[str, Any]:
    """Each rank's Newton–Schulz FLOPs under the plan the optimizer builds from ``groups``
    (the owners do not depend on the rank that builds it), in all and per bucket; None
    where a group's rule orthogonalizes a selection of slices (Dion2)."""
    placements, work, steps = [], [], []
    muon_groups = [g for g in groups if g.get("algorithm") == "muon"]
    defaults = {o.key: o.default for o in MUON_OPTIONS}
    if any(rule_of(g).stack_part(defaults | g, False).fraction is not None for g in muon_groups):
        # Newton–Schulz runs on the slices each step chooses: no count from the plan alone.
        return {
            "ranks": None,
            "owner_imbalance": None,
            "bucket_imbalance": None,
            "standard_ranks": None,
            "standard_imbalance": None,
        }
    for group in muon_groups:
        names = group.get("param_names") or [f"param{i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"], strict=True):
            for view in matrix_views(p.shape, group, name):
                placements.append(placement_of(p, name, view, range(world)))
                gram = takes_gram(group["ns_method"], view.rows, view.cols, cuda)
                work.append(dispatched_flops(view.rows, view.cols, group["ns_steps"], gram))
                steps.append(group["ns_steps"])
    ranks = [0.0] * world
    standard = [0.0] * world
    bucket_max = bucket_mean = 0.0
    if placements:
        plan = build_plan(
            placements,
            0,
            world,
            bucket_bytes=bucket_bytes,
            itemsize=itemsize,
            replica_mode=replica_mode,
            steps=steps,
            backward_order=backward_order,
        )
        standard = [plan.load.get(r, 0.0) for r in range(world)]
        for bucket in plan.buckets:
            loads = [0.0] * world
            for block in bucket.blocks:
                loads[block.owner] += work[block.view] * (block.stop - block.start)
            bucket_max += max(loads)
            bucket_mean += sum(loads) / world
            ranks = [a + b for a, b in zip(ranks, loads, strict=True)]
    return {
        "ranks": ranks,
        "owner_imbalance": imbalance(ranks),
        "bucket_imbalance": bucket_max / bucket_mean if bucket_mean > 0 else None,
        "standard_ranks": standard,
        "standard_imbalance": imbalance(standard),
    }


def plan_of(opt: torch.optim.Optimizer, world: int, cuda: bool) -> dict[str, Any]:
    """:func:`plan_flops` under ``opt``'s settings (no Newton–Schulz work without Muon)."""
    if not isinstance(opt, muon_dist.Muon):
        return plan_flops([], world, cuda, bucket_bytes=1, itemsize=1)
    settings = opt.settings
    return plan_flops(
        opt.param_groups,
        world,
        cuda,
        bucket_bytes=settings.bucket_bytes,
        itemsize=settings.comm_dtype.itemsize,
        replica_mode=settings.replica_mode,
        backward_order=settings.starts_in_backward,
    )


# ---------------------------------------------------------------------------------------
# The table


def _cell(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """One row per phase of one report (slowest rank's medians)."""
    rows = []
    flops = report["plan"]
    for phase, result in report["phases"].items():
        s = result["slowest"]
        ns = s["ns_sum_max"]
        tflops = None
        if ns and flops["ranks"] is not None:
            busiest = max(
                range(len(result["per_rank"])), key=lambda r: result["per_rank"][r]["ns_sum"] or 0
            )
            tflops = flops["ranks"][busiest] / (result["per_rank"][busiest]["ns_sum"] * 1e-3) / 1e12
        rows.append(
            {
                "profile": f"{report['name']} {phase}",
                "ranks": str(report["world_size"]),
                "wall ms": _cell(s["wall"]),
                "NS sum ms": _cell(ns),
                "wall / NS": _cell(s["wall"] / ns if ns else None, 2),
                "NS busy": _cell(s["ns_busy"]),
                "other compute": _cell(s["other_compute"]),
                "exposed comm": _cell(s["exposed_comm"]),
                "idle": _cell(s["idle"]),
                "host": _cell(s["host"]),
                "launch (calls)": "-"
                if s["launch"] is None
                else f"{s['launch']:.1f} ({s['launches']:.0f})",
                "NS TFLOP/s": _cell(tflops, 0),
                "imbalance owners / buckets": f"{_cell(flops['owner_imbalance'], 3)} / "
                f"{_cell(flops['bucket_imbalance'], 3)}",
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, str]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(row[k] for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def notes(report: dict[str, Any]) -> list[str]:
    """What the table cannot say by itself: a run without device kernels, NS's source."""
    out = []
    for phase, result in report["phases"].items():
        source = result["slowest"].get("ns_source")
        if source is None:
            out.append(
                f"{report['name']} {phase}: no device kernels in the trace (a CPU run?): "
                "only the wall time is measured"
            )
        else:
            sums = ", ".join(_cell(r["ns_sum"]) for r in result["per_rank"])
            out.append(
                f"{report['name']} {phase}: Newton–Schulz kernels found by {source}; "
                f"NS sum per rank {sums} ms"
            )
    return out


# ---------------------------------------------------------------------------------------
# The run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def preset_step(
    args: argparse.Namespace,
) -> tuple[Callable[[], None], torch.optim.Optimizer, torch.device, dict[str, str]]:
    """bench_step.py's model and Muon; the step is the optimizer's alone."""
    bench_args = argparse.Namespace(device=args.device, replicate=1)
    device, mesh = bench_step.init_distributed(bench_args)
    layers = args.layers or bench_step.PRESETS[args.preset].layers
    with torch.no_grad():
        model = bench_step.build_model(bench_step.PRESETS[args.preset], layers, mesh, device)
    bench_step.set_random_grads(list(model.parameters()))  # type: ignore[arg-type]
    groups = muon_dist.param_groups(model, lr=bench_step.LR, weight_decay=bench_step.WEIGHT_DECAY)
    opt = muon_dist.Muon(groups, **bench_step.MUON_RULE, backend=args.backend, rule=args.rule)

    @torch.no_grad()
    def step() -> None:
        with record_function(STEP_RANGE):
            opt.step()
            sync(device)

    return step, opt, device, {"step": STEP_RANGE}


def train_step(
    flags: list[str],
) -> tuple[Callable[[], None], torch.optim.Optimizer, torch.device, dict[str, str]]:
    """examples/train.py's model and optimizer on random tokens; a step is forward,
    backward, a sync (as train.py's timer takes) and the optimizer's step."""
    run = train.parse_args(flags)
    env = train.init_distributed()
    mesh = train.build_mesh(env, run.replicate)
    model = train.build_model(run, mesh, env)
    opt = train.build_optimizer(run.optimizer, model, run)
    rows = train.rank_slice(run.batch_size, env.rank, env.world_size)
    tokens = run.batch_size * run.seq_len
    generator = torch.Generator().manual_seed(env.rank)
    shape = (rows.stop - rows.start, run.seq_len + 1)

    def step() -> None:
        batch = torch.randint(0, run.vocab, shape, generator=generator).to(env.device)
        sync(env.device)
        with record_function(STEP_RANGE):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
            )
            (loss * (env.world_size / tokens)).backward()
            sync(env.device)
            with record_function(OPTIMIZER_RANGE):
                opt.step()
                opt.zero_grad()
                sync(env.device)

    return step, opt, env.device, PHASES


def profile_rank(
    step: Callable[[], None], device: torch.device, args: argparse.Namespace, trace_dir: Path
) -> dict[str, Any]:
    """Warm up, profile ``args.steps`` steps (each after a sync and a barrier) and write
    this rank's trace and summary; returns the summary."""
    for _ in range(args.warmup):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            sync(device)
            dist.barrier()
            sync(device)  # the barrier's own kernel stays out of the step's window
            step()
    rank = dist.get_rank()
    path = trace_dir / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    parsed = StepTrace(json.loads(path.read_text()))
    summary = {phase: parsed.steps(name) for phase, name in args.phases.items()}
    (trace_dir / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=1))
    return summary


def parse_args() -> argparse.Namespace:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=sorted(bench_step.PRESETS))
    what.add_argument(
        "--train", action="store_true", help="examples/train.py's step (flags after --)"
    )
    what.add_argument("--from-json", nargs="+", type=Path, help="print the table of reports")
    p.add_argument("--layers", type=int, help="blocks of --preset (default: the preset's)")
    p.add_argument("--backend", choices=muon_dist.kernels.BACKENDS, default="auto")
    p.add_argument(
        "--rule",
        choices=sorted(RULES),
        default="muon",
        help="the update rule of --preset's Muon (dion2: no FLOP count, see plan_flops)",
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps first")
    p.add_argument("--steps", type=int, default=4, help="profiled steps")
    p.add_argument("--name", help="the report's name (default: the preset, or train)")
    p.add_argument("--out", type=Path, default=Path("out/profile_step"))
    p.add_argument(
        "--trace-dir", type=Path, help="keep every rank's trace and summary here (default: dropped)"
    )
    args = p.parse_args(argv[:split])
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers} must be >= 1 (leave it out: the preset's)")
    if args.train and args.rule != "muon":
        p.error(
            f"--rule {args.rule} applies to --preset only; with --train, pass "
            f"--optimizer {args.rule} to examples/train.py after --"
        )
    args.flags = argv[split + 1 :]
    default = args.preset if args.rule == "muon" else f"{args.preset}_{args.rule}"
    args.name = args.name or (default if args.preset else "train")
    return args


def main() -> int:
    args = parse_args()
    if args.from_json:
        reports = [
            tables.read_results(path, "profile_step.py", REPORT_KEYS) for path in args.from_json
        ]
        for report in reports:
            print("\n".join(notes(report)))
        print(format_table([row for r in reports for row in table_rows(r)]))
        return 0
    if args.train:
        step, opt, device, args.phases = train_step(args.flags)
    else:
        step, opt, device, args.phases = preset_step(args)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="profile_step_"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    plan = plan_of(opt, dist.get_world_size(), device.type == "cuda")
    try:
        summary = profile_rank(step, device, args, trace_dir)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, summary)
    finally:
        # A captured step's graph keeps its collectives alive: the optimizer goes first.
        del step, opt
        gc.collect()
        dist.destroy_process_group()
        if args.trace_dir is None:
            shutil.rmtree(trace_dir, ignore_errors=True)
    if rank != 0:
        return 0
    report = {
        "name": args.name,
        "world_size": len(gathered),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "plan": plan,
        "phases": {phase: combine([rank[phase] for rank in gathered]) for phase in args.phases},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_step_{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    print("\n".join(notes(report)))
    print(format_table(table_rows(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
