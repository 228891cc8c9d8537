"""Learning-rate sweeps of examples/train.py on real text: each optimizer at its best.

    python3 benchmarks/sweep.py --gpus 4 --model "~150M (dim 1024, 12 layers)" \\
        --logs runs/sweep --budget-s 540 -- \\
        --data 'corpus/train_*.bin' --eval-data 'corpus/val_*.bin' --dim 1024 --layers 12 \\
        --heads 16 --seq-len 1024 --batch-size 32 --steps 300 --eval-every 15

Every run is a separate process of the example; ``--gpus`` of them train at once, each on
its own GPUs (``--nproc`` ranks per run, torchrun past one). The data is a function of
(seed, step), so every run reads the same tokens in the same order and the eval loss is
taken on the same held-out windows: runs differ by their settings alone.

Without ``--runs`` the grid is searched a line at a time (:class:`Line`: one setting varied
on a log scale, the others fixed), and a line whose best point lies at an edge grows past
it, so each optimizer's best is bracketed. The lines, in the order they are launched:

- AdamW: ``--adamw-lr``;
- Muon, for each ``--adjust-lr``: ``--lr``, its AdamW part at the first ``--muon-adamw-lr``;
- Muon at the best of those: the lr of its AdamW part (embeddings, head, norms);
- where that moved the best, Muon's ``--lr`` again around its best, at the new AdamW part;
- NorMuon and Dion2 at Muon's best settings (one run each).

``--runs`` instead trains the given variants (an optimizer and its own flags, as in
benchmarks/train_table.py), all at once, say to confirm a sweep's best at a larger size.

Scores: the final eval loss of each run, and for each optimizer's best run the tokens it
needed to reach AdamW's best final eval loss (linear between eval points). ``--logs`` gets
each run's log and metrics, ``results.json`` (every run's settings and eval curve, device,
command, date), ``table.md`` and ``sweep.png`` (each optimizer's best eval curve).
``--from-json results.json --write-table`` records the best runs in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tables
from train_table import ROOT, SCRIPT, training_args

BASELINE = "adamw"
ALSO_AT_BEST = ("normuon", "dion2")  # run once each at Muon's best settings
DIVERGED = math.inf  # the score of a run that failed or ended non-finite


@dataclass(frozen=True)
class Config:
    """One run's settings: the optimizer and the flags the sweep varies."""

    optimizer: str
    lr: float | None = None  # Muon's --lr
    adjust_lr: str | None = None
    muon_adamw_lr: float | None = None
    adamw_lr: float | None = None  # --optimizer adamw's lr

    def flags(self) -> list[str]:
        out = ["--optimizer", self.optimizer]
        for key in ("lr", "adjust_lr", "muon_adamw_lr", "adamw_lr"):
            value = getattr(self, key)
            if value is not None:
                out += [f"--{key.replace('_', '-')}", f"{value:g}" if key != "adjust_lr" else value]
        return out

    def label(self) -> str:
        return " ".join(self.flags()[2:]).replace("--", "") or "defaults"

    def with_value(self, axis: str, value: float) -> Config:
        return replace(self, **{axis: value})


def grid_value(x: float) -> float:
    """``x`` at 4 significant digits, so points reached by different products are equal."""
    return float(f"{x:.4g}")


@dataclass
class Line:
    """Points of one setting (``axis``) on a log scale at fixed other settings, grown past
    an edge holding the best score, at most ``grow`` times."""

    base: Config
    axis: str
    points: list[float]
    ratio: float
    grow: int
    grown: int = field(default=0)

    def configs(self) -> list[Config]:
        return [self.base.with_value(self.axis, v) for v in self.points]

    def advance(self, scores: dict[Config, float]) -> list[Config]:
        """The configs still to run: the points without a score, else the next point past
        an edge holding the best (see :meth:`_past_edge`)."""
        missing = [c for c in self.configs() if c not in scores]
        if missing:
            return missing
        new = self._past_edge(scores)
        if new is None:
            return []
        self.points.append(new)
        self.grown += 1
        return [self.base.with_value(self.axis, new)]

    def best(self, scores: dict[Config, float]) -> Config:
        return min(self.configs(), key=lambda c: (scores[c], c.flags()))

    def done(self, scores: dict[Config, float]) -> bool:
        return all(c in scores for c in self.configs()) and self._past_edge(scores) is None

    def _past_edge(self, scores: dict[Config, float]) -> float | None:
        """With every point scored: the point past the edge holding the best, if the line
        may still grow (and the best did not diverge), else None."""
        values = sorted(self.points)
        best = self.best(scores)
        if self.grown >= self.grow or len(values) < 2 or math.isinf(scores[best]):
            return None
        at = getattr(best, self.axis)
        if at == values[0]:
            return grid_value(values[0] / self.ratio)
        if at == values[-1]:
            return grid_value(values[-1] * self.ratio)
        return None


@dataclass
class Grid:
    """The sweep's starting points (see the module docstring for the order of lines)."""

    adamw_lrs: list[float]
    muon_lrs: dict[str, list[float]]  # per adjust_lr
    muon_adamw_lrs: list[float]  # the first is used while Muon's lr is swept
    ratio: float = 2.0
    grow: int = 2


class Planner:
    """Which runs may start, given the scores so far: pure, so it is tested without GPUs."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        g = grid
        self.lines = [Line(Config("adamw", adamw_lr=0.0), "adamw_lr", g.adamw_lrs, g.ratio, g.grow)]
        first_embed = g.muon_adamw_lrs[0]
        for adjust, lrs in g.muon_lrs.items():
            base = Config("muon", lr=0.0, adjust_lr=adjust, muon_adamw_lr=first_embed)
            self.lines.append(Line(base, "lr", list(lrs), g.ratio, g.grow))
        self._stage = 0

    def muon_best(self, scores: dict[Config, float]) -> Config | None:
        muon = [c for c in scores if c.optimizer == "muon"]
        return min(muon, key=lambda c: (scores[c], c.flags())) if muon else None

    def ready(self, scores: dict[Config, float], started: set[Config]) -> list[Config]:
        """Configs to launch now (none started before), in launch order."""
        self._add_dependent_lines(scores)
        out: list[Config] = []
        for line in self.lines:
            out += [c for c in line.advance(scores) if c not in started and c not in out]
        if self._stage == 3:
            best = self.muon_best(scores)
            assert best is not None
            out += [
                c
                for c in (replace(best, optimizer=name) for name in ALSO_AT_BEST)
                if c not in started and c not in out
            ]
        return out

    def finished(self, scores: dict[Config, float], started: set[Config]) -> bool:
        return not self.ready(scores, started) and all(c in scores for c in started)

    def _add_dependent_lines(self, scores: dict[Config, float]) -> None:
        """Open the next stage's lines while every Muon line so far is done."""
        while self._stage < 3 and all(
            line.done(scores) for line in self.lines if line.base.optimizer == "muon"
        ):
            self._next_stage(scores)

    def _next_stage(self, scores: dict[Config, float]) -> None:
        best = self.muon_best(scores)
        assert best is not None
        g = self.grid
        if self._stage == 0:
            points = sorted({*g.muon_adamw_lrs, best.muon_adamw_lr or g.muon_adamw_lrs[0]})
            self.lines.append(Line(best, "muon_adamw_lr", points, g.ratio, g.grow))
            self._stage = 1
        elif self._stage == 1:
            if best.muon_adamw_lr != g.muon_adamw_lrs[0]:
                assert best.lr is not None
                points = [grid_value(best.lr / g.ratio), best.lr, grid_value(best.lr * g.ratio)]
                self.lines.append(Line(best, "lr", points, g.ratio, g.grow))
            self._stage = 2
        else:
            self._stage = 3


# ---------------------------------------------------------------------------------------
# Scores


def eval_curve(metrics: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """(tokens, eval loss) of every eval, in step order."""
    rows = sorted((r for r in metrics if "eval_loss" in r), key=lambda r: r["step"])
    return [(int(r["tokens"]), float(r["eval_loss"])) for r in rows]


def final_score(curve: Sequence[tuple[int, float]], exit_code: int) -> float:
    """The last eval loss; a run that failed or ended non-finite scores :data:`DIVERGED`."""
    if exit_code != 0 or not curve or not math.isfinite(curve[-1][1]):
        return DIVERGED
    return curve[-1][1]


def tokens_to_reach(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """Tokens at which the eval loss first reaches ``target``, linear between evals (the
    first eval's tokens where it is already there), or None if it never does."""
    previous: tuple[int, float] | None = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(tokens)
            t0, l0 = previous
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
        previous = (tokens, loss)
    return None


def best_runs(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per optimizer, its run with the lowest final eval loss (first-seen optimizer order)."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs:
        name = run["config"]["optimizer"]
        if name not in best or run["score"] < best[name]["score"]:
            best[name] = run
    return best


def unbracketed(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[str]:
    """The settings of ``run`` that no run of its optimizer, alike in every other setting,
    tried on both sides of: there, a better value may lie outside the sweep."""
    config = Config(**run["config"])
    out = []
    for axis in ("lr", "muon_adamw_lr", "adamw_lr"):
        value = getattr(config, axis)
        if value is None:
            continue
        others = [
            getattr(c, axis)
            for c in (Config(**r["config"]) for r in runs)
            if c.with_value(axis, value) == config
        ]
        if not (min(others) < value < max(others)):
            out.append(axis.replace("_", "-"))
    return out


def summary_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """The sweep table's rows: each optimizer's best run and its tokens to AdamW's best."""
    best = best_runs(results["runs"])
    target = best[BASELINE]["score"] if BASELINE in best else None
    adamw_tokens = None if target is None else tokens_to_reach(best[BASELINE]["curve"], target)
    rows = []
    for name, run in best.items():
        reach = tokens_to_reach(run["curve"], target) if target is not None else None
        ratio = f"{reach / adamw_tokens:.3f}×" if reach and adamw_tokens else "not reached"
        tried = sum(r["config"]["optimizer"] == name for r in results["runs"])
        rows.append(
            {
                "model": results["model"],
                "tokens": f"{results['tokens_per_run'] / 1e6:.1f}M",
                "optimizer": name,
                "best settings": Config(**run["config"]).label(),
                "final eval loss": f"{run['score']:.4f}",
                "tokens to AdamW's best": f"{reach / 1e6:.2f}M" if reach else "not reached",
                "vs AdamW": ratio,
                "runs": str(tried),
                "best at an edge": ", ".join(unbracketed(run, results["runs"])) or "no",
            }
        )
    return rows


def grid_lines(results: dict[str, Any]) -> list[str]:
    """Every run's final eval loss, grouped by optimizer, best first."""
    lines = ["| optimizer | settings | final eval loss | wall s |", "| --- | --- | --- | --- |"]
    for run in sorted(results["runs"], key=lambda r: (r["config"]["optimizer"], r["score"])):
        config = Config(**run["config"])
        score = "diverged" if math.isinf(run["score"]) else f"{run['score']:.4f}"
        lines.append(f"| {config.optimizer} | {config.label()} | {score} | {run['wall_s']:.0f} |")
    return lines


def merged(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sweeps of one model, flags and device (say, a search and the runs that extended it)
    as one: their runs together, their commands in order."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("model", "flags", "tokens_per_run"):
            if part[key] != first[key]:
                raise SystemExit(f"--from-json: {key} differs ({part[key]!r}, {first[key]!r})")
        if part["run"]["device"] != first["run"]["device"]:
            raise SystemExit("--from-json: the sweeps ran on different devices")
    commands = list(dict.fromkeys(part["run"]["command"] for part in parts))
    return {
        **first,
        "run": {**first["run"], "command": " && ".join(commands)},
        "runs": [run for part in parts for run in part["runs"]],
        "unfinished": [],
    }


def report(results: dict[str, Any], logs: Path | None, write_table: bool) -> None:
    rows = summary_rows(results)
    with tempfile.TemporaryDirectory() as scratch:
        tables.store("sweep", rows, results["run"], Path(scratch))
        text = tables.markdown("sweep", Path(scratch))
    text += "\n" + "\n".join(grid_lines(results)) + "\n"
    if results.get("unfinished"):
        text += f"\nNot run (time budget): {', '.join(results['unfinished'])}\n"
    if logs is not None:
        (logs / "table.md").write_text(text)
        plot(results, logs / "sweep.png")
    if write_table:
        tables.record("sweep", rows, results["run"])
    print(text, end="")


def plot(results: dict[str, Any], path: Path) -> None:
    """Each optimizer's best eval curve against tokens, AdamW's best final loss dashed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no sweep.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_runs(results["runs"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in best.items():
        if run["curve"]:
            tokens, losses = zip(*run["curve"], strict=True)
            label = f"{name} ({Config(**run['config']).label()})"
            ax.plot([t / 1e6 for t in tokens], losses, "o-", ms=3, label=label)
    if BASELINE in best and math.isfinite(best[BASELINE]["score"]):
        ax.axhline(best[BASELINE]["score"], ls="--", c="gray", lw=1, label="AdamW's best final")
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(f"{results['model']}: each optimizer at its best swept settings", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Launching


@dataclass
class Slot:
    """A set of GPUs (or, without GPUs, the CPU) that trains one run at a time."""

    devices: str | None
    process: subprocess.Popen[bytes] | None = None
    config: Config | None = None
    out: Path | None = None
    began: float = 0.0


def start(slot: Slot, nproc: int, config: Config, flags: Sequence[str], out: Path) -> None:
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", str(nproc), str(SCRIPT)]
    else:
        argv = [sys.executable, str(SCRIPT)]
    argv += [*flags, *config.flags(), "--out", str(out), "--no-progress"]
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if slot.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot.devices
    log = (out / "train.log").open("w")
    slot.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log)
    log.close()
    slot.config, slot.out, slot.began = config, out, time.perf_counter()


def collect(slot: Slot) -> dict[str, Any]:
    """The finished run of ``slot``: settings, exit code, eval curve and score."""
    assert slot.process is not None and slot.config is not None and slot.out is not None
    code = slot.process.wait()
    metrics_path = slot.out / "metrics.jsonl"
    metrics = []
    if metrics_path.is_file():
        metrics = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    curve = eval_curve(metrics)
    run = {
        "config": slot.config.__dict__,
        "exit_code": code,
        "wall_s": time.perf_counter() - slot.began,
        "curve": curve,
        "score": final_score(curve, code),
        "argv": slot.process.args,
        "log_tail": (slot.out / "train.log").read_text().splitlines()[-5:] if code else [],
    }
    slot.process, slot.config, slot.out = None, None, None
    return run


def device_sets(gpus: int, nproc: int) -> list[str | None]:
    """One entry per slot: its CUDA_VISIBLE_DEVICES, or None on a machine without GPUs."""
    if gpus == 0:
        return [None]
    if gpus % nproc:
        raise SystemExit(f"--gpus {gpus} is not a multiple of --nproc {nproc}")
    return [
        ",".join(str(d) for d in range(s * nproc, (s + 1) * nproc)) for s in range(gpus // nproc)
    ]


def sweep(args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    """Run the planned (or the given) configs on every slot until done or out of budget."""
    parsed = training_args(flags)
    if parsed.data is None:
        raise SystemExit("a sweep scores the eval loss on held-out text: give --data")
    planner = None if args.runs else Planner(grid_from(args))
    fixed = [config_of(v) for v in args.runs] if args.runs else []
    slots = [Slot(d) for d in device_sets(args.gpus, args.nproc)]
    scores: dict[Config, float] = {}
    started: set[Config] = set()
    runs: list[dict[str, Any]] = []
    began = time.perf_counter()
    longest = 0.0
    unfinished: list[str] = []
    command = tables.command_line()
    args.logs.mkdir(parents=True, exist_ok=True)
    while True:
        ready = (
            planner.ready(scores, started) if planner else [c for c in fixed if c not in started]
        )
        for slot in slots:
            if slot.process is not None or not ready:
                continue
            if args.budget_s and time.perf_counter() - began + longest > args.budget_s:
                unfinished = [c.label() for c in ready]
                ready = []
                break
            config = ready.pop(0)
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", f"{config.optimizer}_{config.label()}")
            start(slot, args.nproc, config, flags, args.logs / f"{len(started):02d}_{slug}")
            started.add(config)
            print(f"started {config.optimizer} {config.label()}", flush=True)
        busy = [s for s in slots if s.process is not None]
        if not busy:
            break
        for slot in busy:
            assert slot.process is not None
            if slot.process.poll() is not None:
                run = collect(slot)
                longest = max(longest, run["wall_s"])
                config = Config(**run["config"])
                scores[config] = run["score"]
                runs.append(run)
                print(
                    f"done {config.optimizer} {config.label()}: {run['score']:.4f}"
                    f" ({run['wall_s']:.0f} s)",
                    flush=True,
                )
        time.sleep(1.0)
    results = {
        "model": args.model,
        "flags": flags,
        "tokens_per_run": parsed.batch_size * parsed.seq_len * parsed.steps,
        "run": tables.run_info(gpus=max(1, args.gpus), command=command),
        "runs": runs,
        "unfinished": unfinished,
    }
    (args.logs / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return results


def config_of(variant: str) -> Config:
    """``"muon --lr 0.02 --adjust-lr rms_norm"`` as a :class:`Config`."""
    optimizer, *extra = shlex.split(variant)
    p = argparse.ArgumentParser(prog=f"--runs {variant!r}", add_help=False)
    p.add_argument("--lr", type=float)
    p.add_argument("--adjust-lr")
    p.add_argument("--muon-adamw-lr", type=float)
    p.add_argument("--adamw-lr", type=float)
    return Config(optimizer, **vars(p.parse_args(extra)))


def grid_from(args: argparse.Namespace) -> Grid:
    muon_lrs = {}
    for spec in args.muon_lrs:
        adjust, _, values = spec.partition("=")
        muon_lrs[adjust] = [grid_value(float(v)) for v in values.split(",")]
    return Grid(
        adamw_lrs=[grid_value(v) for v in args.adamw_lrs],
        muon_lrs=muon_lrs,
        muon_adamw_lrs=[grid_value(v) for v in args.muon_adamw_lrs],
        grow=args.grow,
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: one run at a time on CPU)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) per run")
    p.add_argument("--model", default="", help="the table's model column, e.g. its size")
    p.add_argument("--logs", type=Path, default=Path("runs/sweep"))
    p.add_argument("--budget-s", type=float, default=0, help="start no run that would end later")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    p.add_argument(
        "--muon-lrs",
        nargs="+",
        default=["spectral_norm=0.01,0.02,0.04", "rms_norm=1e-3,2e-3,4e-3"],
        help="ADJUST_LR=LR,LR,... per adjust_lr",
    )
    p.add_argument("--muon-adamw-lrs", type=float, nargs="+", default=[4e-3, 2e-3, 8e-3])
    p.add_argument("--grow", type=int, default=2, help="points a line may add past its edges")
    p.add_argument("--runs", nargs="+", default=None, help="train these variants, no search")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="report finished sweeps again; several of the same model and flags as one",
    )
    p.add_argument("--plot", type=Path, default=None, help="with --from-json: write the plot")
    p.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = p.parse_args(own)
    if args.from_json is not None:
        results = merged([json.loads(path.read_text()) for path in args.from_json])
        report(results, None, args.write_table)
        if args.plot is not None:
            plot(results, args.plot)
        return
    results = sweep(args, flags)
    report(results, args.logs, args.write_table)


if __name__ == "__main__":
    main()
