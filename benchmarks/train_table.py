"""Compare optimizers on examples/train.py: interleaved, repeated runs, medians with spreads.

    python3 benchmarks/train_table.py --nproc 4 --model "~1B dense (dim 2048, 20 layers)" \\
        --variants adamw muon "muon --overlap backward" --repeats 3 --skip 10 --logs runs/b64 -- \\
        --dim 2048 --layers 20 --heads 16 --vocab 8192 --seq-len 1024 --batch-size 64 --steps 25

Each variant is an optimizer of the example followed by any flags of its own; the flags
after ``--`` go to every run. The runs are separate torchrun launches, interleaved round by
round (A B C, A B C, ...) so that a machine that drifts (clocks, temperature, neighbours)
drifts under every variant alike. Each run's steps after the first ``--skip`` give medians
of the slowest rank's forward+backward, exposed optimizer time and step time
(``metrics.jsonl``, see the README's "The main job"); tokens/s is tokens per step over the
median step. A variant's cell is the median of its runs' medians, with their min–max; its
ratio to AdamW is the ratio of the median tokens/s, with the min–max of the ratios of runs
paired by round (each variant's run against AdamW's run of the same round).

``--logs`` gets every run's log and ``metrics.jsonl``, ``results.json`` (every per-step
number of every run, the run order, device, versions, date and command) and ``table.md``.
``--from-json results.json`` prints the table of a finished comparison again, and with
``--write-table`` records it in benchmarks/README.md (say, on this machine, from the JSON
a GPU machine wrote).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import tables

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
BASELINE = "adamw"
# Per-step seconds in metrics.jsonl, each the slowest rank's.
PHASES = ("fwd_bwd_s", "opt_s", "step_s", "data_wait_s")
LEGEND = (
    "Cells: median over runs of each run's median over its timed steps (min–max over runs). "
    "data wait: the step's wait for its batch, before its clock starts (left out of tokens/s). "
    "vs AdamW: ratio of the median tokens/s (min–max over the runs paired by round)."
)


def training_args(flags: Sequence[str]) -> argparse.Namespace:
    """The example's own parse of ``flags`` (so a typo fails before the first launch)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))  # train.py imports its neighbours
    import train

    return train.parse_args(list(flags))


def check_data(parsed: argparse.Namespace) -> None:
    """``--data`` and ``--eval-data`` name files, or an exit naming the flag and pattern
    (each run would otherwise fail alone, after the ones before it trained)."""
    from corpus import resolve  # beside train.py, on the path training_args set

    for flag in ("data", "eval_data"):
        pattern = getattr(parsed, flag)
        if pattern is not None:
            try:
                resolve(pattern, f"--{flag.replace('_', '-')}")
            except ValueError as error:
                raise SystemExit(str(error)) from None


def check_fresh(folder: Path, flag: str) -> None:
    """``folder`` does not exist or is empty: a run never writes over an earlier one's logs."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SystemExit(
            f"{flag} {folder} already exists and is not an empty folder: its runs and results "
            f"would be overwritten; choose a new {flag} (or move that one away)"
        )


def variant_flags(variant: str) -> list[str]:
    """``"muon --overlap backward"`` -> ``--optimizer muon --overlap backward``."""
    optimizer, *extra = shlex.split(variant)
    return ["--optimizer", optimizer, *extra]


def schedule(variants: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``(round, variant)`` in launch order: every variant once per round, rounds in turn."""
    return [(round_, variant) for round_ in range(repeats) for variant in variants]


def run_logged(argv: Sequence[str], env: dict[str, str], log: Path) -> int:
    """Run ``argv`` from the repository root, its output into ``log``; its exit code. A
    module-level function so that tests can run most launches forked from a process that
    imported torch once (tests/tooling/test_train_table_slow.py)."""
    with log.open("w") as out:
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc.returncode


def launch(nproc: int, flags: Sequence[str], out: Path) -> dict[str, Any]:
    """One torchrun run of the example into ``out``; its metrics, argv and wall time."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", str(nproc), str(SCRIPT), *flags]
    argv += ["--out", str(out), "--no-progress", "--no-plot"]
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    begin = time.perf_counter()
    code = run_logged(argv, env, out / "train.log")
    wall = time.perf_counter() - begin
    if code != 0:
        tail = (out / "train.log").read_text().splitlines()[-40:]
        raise SystemExit(f"{shlex.join(argv)} exited {code}:\n" + "\n".join(tail))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    return {"argv": argv, "started": started, "wall_s": wall, "metrics": metrics}


def run_medians(run: dict[str, Any], skip: int) -> dict[str, float]:
    """Median of each phase over the steps after the first ``skip``; tokens/s from the step."""
    steps = sorted(run["metrics"], key=lambda r: r["step"])
    timed = steps[skip:]
    if not timed:
        raise ValueError(f"{run['variant']}: {len(steps)} steps, none left after --skip {skip}")
    medians = {phase: statistics.median(r[phase] for r in timed) for phase in PHASES}
    tokens_per_step = steps[0]["tokens"] // steps[0]["step"]
    medians["tokens_per_s"] = tokens_per_step / medians["step_s"]
    return medians


def spread(values: Sequence[float], middle: float | None = None) -> dict[str, float]:
    """The median of ``values`` (or ``middle``) with their min and max."""
    center = statistics.median(values) if middle is None else middle
    return {"median": center, "min": min(values), "max": max(values)}


def summarize(runs: Sequence[dict[str, Any]], skip: int) -> dict[str, dict[str, Any]]:
    """Per variant, in first-run order: each metric's median of run medians and its spread,
    and tokens/s against the baseline's (ratio of medians; min–max of per-round ratios)."""
    per_run = [run_medians(run, skip) for run in runs]
    variants = list(dict.fromkeys(run["variant"] for run in runs))
    if BASELINE not in variants:
        raise ValueError(f"variants {variants} lack {BASELINE!r}: ratios are to AdamW")
    by_round = {
        (run["round"], run["variant"]): medians for run, medians in zip(runs, per_run, strict=True)
    }
    summary: dict[str, dict[str, Any]] = {}
    for variant in variants:
        mine = [m for run, m in zip(runs, per_run, strict=True) if run["variant"] == variant]
        entry: dict[str, Any] = {"runs": len(mine)}
        for metric in (*PHASES, "tokens_per_s"):
            entry[metric] = spread([m[metric] for m in mine])
        summary[variant] = entry
    add_vs_baseline(summary, by_round)
    return summary


def add_vs_baseline(
    summary: dict[str, dict[str, Any]], by_round: dict[tuple[int, str], dict[str, float]]
) -> None:
    """Each variant's tokens/s against the baseline's: the ratio of their medians, with the
    min–max of the ratios of runs paired by round."""
    base = summary[BASELINE]["tokens_per_s"]["median"]
    for variant, entry in summary.items():
        rounds = sorted(r for r, v in by_round if v == variant and (r, BASELINE) in by_round)
        paired = [
            by_round[r, variant]["tokens_per_s"] / by_round[r, BASELINE]["tokens_per_s"]
            for r in rounds
        ]
        entry["vs_baseline"] = spread(paired, entry["tokens_per_s"]["median"] / base)


def cell(values: dict[str, float], scale: float, fmt: str, unit: str = "") -> str:
    """``median (min–max)`` of a spread, each value times ``scale`` in format ``fmt``."""
    low, mid, high = (format(values[k] * scale, fmt) for k in ("min", "median", "max"))
    return f"{mid}{unit} ({low}–{high}{unit})"


def table_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """The training table's rows of one comparison."""
    rows = []
    for variant, entry in results["summary"].items():
        rows.append(
            {
                "model": results["model"],
                "GPUs": str(results["nproc"]),
                "batch": str(results["batch"][variant]),
                "optimizer": variant,
                "forward+backward ms": cell(entry["fwd_bwd_s"], 1e3, ".1f"),
                "exposed optimizer ms": cell(entry["opt_s"], 1e3, ".1f"),
                "step ms": cell(entry["step_s"], 1e3, ".1f"),
                "tokens/s": cell(entry["tokens_per_s"], 1, ",.0f"),
                "data wait ms": cell(entry["data_wait_s"], 1e3, ".2f"),
                "vs AdamW": cell(entry["vs_baseline"], 1, ".3f", "×"),
                "runs": f"{entry['runs']} × {results['timed_steps'][variant]} steps",
            }
        )
    return rows


def report(results: dict[str, Any], logs: Path | None, write_table: bool) -> None:
    """Print the table (and write it to ``logs/table.md``); record it in benchmarks/ if asked."""
    rows = table_rows(results)
    with tempfile.TemporaryDirectory() as scratch:
        tables.store("training", rows, results["run"], Path(scratch))
        text = f"{tables.markdown('training', Path(scratch))}\n{LEGEND}\n"
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "table.md").write_text(text)
    if write_table:
        tables.record("training", rows, results["run"])
    for variant, entry in results["summary"].items():
        wait, step = entry["data_wait_s"]["max"], entry["step_s"]["median"]
        if wait > 0.01 * step:
            print(
                f"note: {variant} waited {wait * 1e3:.1f} ms (a run's median) for its batch: "
                "the data was not ready in time, and tokens/s leaves that wait out"
            )
    print(text, end="")


def checked_batches(args: argparse.Namespace, flags: list[str]) -> dict[str, int]:
    """Each variant's global batch, after checking every run's flags as the example and the
    table will read them: a comparison that cannot give a table fails before it trains."""
    batch = {}
    for variant in args.variants:
        parsed = training_args([*flags, *variant_flags(variant)])
        if parsed.compare is not None:
            raise SystemExit("--compare runs optimizers in one process: give --variants instead")
        steps = parsed.stop_after or parsed.steps
        if args.skip >= steps:
            raise SystemExit(
                f"--skip {args.skip} leaves none of the {steps} steps of {variant!r} (--steps "
                f"{parsed.steps}) to time: pass --skip below {steps} or more --steps"
            )
        if parsed.batch_size < args.nproc:
            raise SystemExit(
                f"--batch-size {parsed.batch_size} is smaller than --nproc {args.nproc}: every "
                "rank needs at least one sequence; pass a larger --batch-size"
            )
        check_data(parsed)
        batch[variant] = parsed.batch_size
    check_fresh(args.logs, "--logs")
    return batch


def compare(args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    """Launch every run in interleaved order; the results with every raw number."""
    batch = checked_batches(args, flags)
    command = tables.command_line()
    args.logs.mkdir(parents=True, exist_ok=True)
    runs = []
    order = schedule(args.variants, args.repeats)
    for index, (round_, variant) in enumerate(order):
        slug = re.sub(r"[^A-Za-z0-9]+", "_", variant).strip("_")
        out = args.logs / f"{index:02d}_{slug}"
        run = launch(args.nproc, [*flags, *variant_flags(variant)], out)
        print(
            f"[{index + 1}/{len(order)}] round {round_ + 1}: {variant}, {run['wall_s']:.0f} s",
            flush=True,
        )
        runs.append({"index": index, "round": round_, "variant": variant, **run})
    timed = {
        variant: len(next(r for r in runs if r["variant"] == variant)["metrics"]) - args.skip
        for variant in args.variants
    }
    results = {
        "model": args.model,
        "nproc": args.nproc,
        "batch": batch,
        "skip": args.skip,
        "timed_steps": timed,
        "flags": flags,
        "variants": list(args.variants),
        "repeats": args.repeats,
        # Read after the runs, so this process holds no GPU while they train.
        "run": tables.run_info(gpus=args.nproc, command=command),
        "runs": runs,
        "summary": summarize(runs, args.skip),
    }
    (args.logs / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return results


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun)")
    parser.add_argument("--model", help="the table's model column, e.g. its size")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[BASELINE, "muon"],
        help='an optimizer and its own flags each, e.g. adamw muon "muon --overlap backward"',
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of medians")
    parser.add_argument("--logs", type=Path, help="runs, results.json and table.md go here")
    parser.add_argument("--from-json", type=Path, help="report a finished comparison again")
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args(own)
    if args.from_json is not None:
        if flags:
            parser.error("--from-json takes no training flags")
        keys = ("model", "nproc", "batch", "timed_steps", "summary", "run")
        results = tables.read_results(args.from_json, "train_table.py", keys)
        report(results, args.logs, args.write_table)
        return
    if args.model is None or args.logs is None:
        parser.error("a comparison needs --model and --logs")
    if args.repeats < 1 or args.skip < 0 or args.nproc < 1:
        parser.error(
            f"--repeats {args.repeats} and --nproc {args.nproc} must be >= 1 and --skip "
            f"{args.skip} >= 0"
        )
    if BASELINE not in args.variants or len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants must be distinct and include {BASELINE}: ratios are to AdamW")
    report(compare(args, flags), args.logs, args.write_table)


if __name__ == "__main__":
    main()
