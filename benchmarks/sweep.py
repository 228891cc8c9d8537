"""Sweeps of examples/train.py on real text: each optimizer at its own best lr and warmup.

    python3 benchmarks/sweep.py --gpus 4 --model "~150M (dim 1024, 12 layers)" \\
        --logs runs/sweep --budget-s 480 \\
        --adamw-lrs 2.5e-4 1.25e-4 5e-4 --adamw-warmups 60 30 120 \\
        --muon-lrs 0.01 0.005 0.02 --muon-warmups 30 15 60 -- \\
        --data 'corpus/train_*.bin' --eval-data 'corpus/val_*.bin' --dim 1024 --layers 12 \\
        --heads 16 --seq-len 1024 --batch-size 32 --steps 300 --eval-every 20

Every run is a separate process of the example; ``--gpus`` of them train at once, each on
its own GPUs (``--nproc`` ranks per run, torchrun past one; under ``CUDA_VISIBLE_DEVICES``
the slots take the GPUs it lists). The data is a function of (seed, step), so every run
reads the same tokens in the same order and the eval loss is taken on the same held-out
windows: runs differ by their settings alone.

Without ``--runs`` each optimizer's settings are searched a line at a time (:class:`Line`:
one setting varied on a log scale, the others fixed; a line whose best point lies at an
edge grows past it). :class:`Search` runs a line per axis in turn, each through the best
so far: the lr (with each other axis at its first value), then the warmup at the best lr,
then, where the warmup moved the best, the lr again around it, and so on while an axis has
no line through the best (at most ``--passes`` lines per axis). So every best is bracketed
on every axis, unless a line hit its limit (then the table says so). AdamW and Muon are
searched side by side, each from its own starting points. ``--seeds 0 1`` repeats each
optimizer's best at seed 1 (the search runs at the first seed): the spread of the repeats
is the run-to-run noise. ``--also normuon dion2`` runs those once at Muon's best.

``--runs`` instead trains the given variants at each seed, and ``--best-of results.json``
each optimizer's best settings of a finished sweep (say, to confirm them at a larger size,
or to repeat them at another seed and merge the two with ``--from-json``). A variant with
``--momentum-dtype bf16`` is an optimizer of its own ("muon-bf16m", :attr:`Config.name`):
its own best, row and edge check, so bf16 and fp32 momenta each compete at their own lr.

Scores: the final eval loss of each run; for each optimizer's best settings, at each seed,
the tokens and the wall time (the runs' own timed steps, ``elapsed`` in metrics.jsonl; no
evals, no data waits) at which its eval curve first reaches AdamW's final eval loss at that
seed (linear between evals), and their ratios to AdamW's own. ``--logs`` gets each run's
log and metrics, ``results.json``, ``table.md`` and ``sweep.png``. ``--from-json A B
--write-table`` records the best runs in benchmarks/README.md and the budget row (tokens
per parameter) in it and the README (``--record muon-bf16m`` records only that row, say
beside rows of a fuller search; the budget row only with both adamw and muon);
``--write-defaults`` puts the bests in examples/defaults.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tables
from train_table import ROOT, SCRIPT, check_data, check_fresh, training_args

BASELINE = "adamw"
MUON = "muon"
DIVERGED = math.inf  # the score of a run that failed or ended non-finite
CRASHED = "crashed"  # a run that failed without a non-finite loss: not the settings' fault
LOG_TAIL = 20  # lines of a crashed run's log kept in results.json and printed
AXES = ("lr", "muon_adamw_lr", "adamw_lr", "warmup")  # the settings a sweep varies
RESULT_KEYS = ("model", "flags", "tokens_per_run", "run", "runs")
RUN_KEYS = ("config", "score", "curve", "wall_s")
DEFAULTS = ROOT / "examples" / "defaults.py"


@dataclass(frozen=True)
class Config:
    """One run's settings: the optimizer, the flags the sweep varies, and the seed."""

    optimizer: str
    lr: float | None = None  # Muon's --lr
    adjust_lr: str | None = None
    muon_adamw_lr: float | None = None
    adamw_lr: float | None = None  # --optimizer adamw's lr
    warmup: int | None = None
    momentum_dtype: str | None = None  # "bf16"; None: the example's default, fp32
    seed: int = 0

    @property
    def name(self) -> str:
        """The variant's name in the tables: the optimizer, with the momentum dtype where it
        is not fp32 ("muon-bf16m"), so each momentum dtype is compared at its own best."""
        if self.momentum_dtype is None:
            return self.optimizer
        return f"{self.optimizer}-{self.momentum_dtype}m"

    def flags(self) -> list[str]:
        out = ["--optimizer", self.optimizer]
        for key in ("lr", "adjust_lr", "muon_adamw_lr", "adamw_lr", "warmup", "momentum_dtype"):
            value = getattr(self, key)
            if value is not None:
                shown = value if isinstance(value, str) else f"{value:g}"
                out += [f"--{key.replace('_', '-')}", shown]
        return out + (["--seed", str(self.seed)] if self.seed else [])

    def settings(self) -> Config:
        """The same settings at seed 0: what runs at several seeds share."""
        return replace(self, seed=0)

    def label(self) -> str:
        """The settings as flags, without the optimizer and the seed."""
        return " ".join(self.settings().flags()[2:]).replace("--", "") or "defaults"

    def with_value(self, axis: str, value: float) -> Config:
        return replace(self, **{axis: grid_value(axis, value)})


def grid_value(axis: str, x: float) -> Any:
    """``x`` as the axis holds it: warmup steps as an int, an lr at 4 significant digits
    (so points reached by different products are equal)."""
    return round(x) if axis == "warmup" else float(f"{x:.4g}")


def config_from(entry: dict[str, Any]) -> Config:
    """A run's ``config`` from results.json (older files lack warmup, momentum_dtype and
    seed)."""
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in entry.items() if k in known})


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
        may still grow (and the best did not diverge, and the point is new), else None."""
        values = sorted(self.points)
        best = self.best(scores)
        if self.grown >= self.grow or len(values) < 2 or math.isinf(scores[best]):
            return None
        at = getattr(best, self.axis)
        new = None
        if at == values[0]:
            new = grid_value(self.axis, values[0] / self.ratio)
        elif at == values[-1]:
            new = grid_value(self.axis, values[-1] * self.ratio)
        return None if new is None or new in values or new <= 0 else new


@dataclass
class Search:
    """One optimizer's search: lines through its best so far, one axis at a time.

    ``base`` holds every axis at the first of its ``axes`` points. The first line varies
    the first axis over its points; then, while some axis has no line through the best,
    a line on it opens there: over its given points the first time, over the best's value
    and its neighbours (one ``ratio`` apart) after that, at most ``passes`` lines an axis.
    """

    base: Config
    axes: dict[str, list[float]]
    ratio: float = 2.0
    grow: int = 2
    passes: int = 2
    lines: list[Line] = field(default_factory=list)

    def ready(self, scores: dict[Config, float]) -> list[Config]:
        """Configs to run next (some may have started): the open lines' missing points, or
        the next line's."""
        if not self.lines:
            axis, points = next(iter(self.axes.items()))
            self._open(self.base, axis, points)
        while True:
            out = [c for line in self.lines for c in line.advance(scores)]
            if out or not all(line.done(scores) for line in self.lines):
                return out
            if self._next_line(scores) is None:  # opens it, if there is one
                return []

    def done(self, scores: dict[Config, float]) -> bool:
        return (
            bool(self.lines)
            and all(line.done(scores) for line in self.lines)
            and self._next_line(scores, peek=True) is None
        )

    def best(self, scores: dict[Config, float]) -> Config:
        tried = {c for line in self.lines for c in line.configs() if c in scores}
        return min(tried, key=lambda c: (scores[c], c.flags()))

    def _open(self, base: Config, axis: str, points: Sequence[float]) -> Line:
        values = sorted({grid_value(axis, v) for v in points})
        line = Line(base, axis, values, self.ratio, self.grow)
        self.lines.append(line)
        return line

    def _next_line(self, scores: dict[Config, float], peek: bool = False) -> Line | None:
        best = self.best(scores)
        if math.isinf(scores[best]):
            return None  # every run diverged: no best to search around
        for axis, points in self.axes.items():
            on_axis = [line for line in self.lines if line.axis == axis]
            if any(best in line.configs() for line in on_axis) or len(on_axis) >= self.passes:
                continue
            value = getattr(best, axis)
            around = [value / self.ratio, value, value * self.ratio]
            chosen = [*points, value] if not on_axis else around
            if peek:
                return Line(best, axis, list(chosen), self.ratio, self.grow)
            return self._open(best, axis, chosen)
        return None


class Planner:
    """Which runs may start, given the scores so far: pure, so it is tested without GPUs.

    Each search runs at the first of ``seeds``; once it is done its best runs again at the
    other seeds, and (for Muon) once under each rule of ``also``.
    """

    def __init__(
        self, searches: Sequence[Search], seeds: Sequence[int] = (0,), also: Sequence[str] = ()
    ) -> None:
        self.searches = list(searches)
        self.seeds = list(seeds)
        self.also = list(also)

    def ready(self, scores: dict[Config, float], started: set[Config]) -> list[Config]:
        """Configs to launch now (none started before), in launch order."""
        out: list[Config] = []
        for search in self.searches:
            out += search.ready(scores)
        for search in self.searches:
            if not search.done(scores):
                continue
            best = search.best(scores)
            if math.isinf(scores[best]):
                continue
            out += [replace(best, seed=seed) for seed in self.seeds[1:]]
            if best.name == MUON:
                out += [replace(best, optimizer=name) for name in self.also]
        return [c for c in dict.fromkeys(out) if c not in started]

    def finished(self, scores: dict[Config, float], started: set[Config]) -> bool:
        return not self.ready(scores, started) and all(c in scores for c in started)


# ---------------------------------------------------------------------------------------
# Scores


def eval_curve(metrics: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(tokens, eval loss, elapsed seconds of timed steps) of every eval, in step order."""
    rows = sorted((r for r in metrics if "eval_loss" in r), key=lambda r: r["step"])
    return [(int(r["tokens"]), float(r["eval_loss"]), float(r["elapsed"])) for r in rows]


def final_score(curve: Sequence[Sequence[float]], exit_code: int) -> float:
    """The last eval loss; a run that failed or ended non-finite scores :data:`DIVERGED`."""
    if exit_code != 0 or not curve or not math.isfinite(curve[-1][1]):
        return DIVERGED
    return float(curve[-1][1])


def run_status(metrics: Sequence[dict[str, Any]], exit_code: int) -> str:
    """ "diverged" where the run logged a non-finite loss (train.py logs that step, then
    stops), "crashed" where it failed otherwise (a missing file, a bad flag, a dead rank),
    else "ok"."""
    losses = [r.get("loss", 0.0) for r in metrics] + [r.get("eval_loss", 0.0) for r in metrics]
    if not all(math.isfinite(x) for x in losses):
        return "diverged"
    return CRASHED if exit_code != 0 or not eval_curve(metrics) else "ok"


def status_of(run: dict[str, Any]) -> str:
    """A run's status; results.json of older sweeps has none (a failure there was "diverged")."""
    return str(run.get("status") or ("diverged" if math.isinf(run["score"]) else "ok"))


def reach(curve: Sequence[Sequence[float]], target: float, column: int) -> float | None:
    """Column ``column`` of the curve (0: tokens, 2: elapsed seconds) where the eval loss
    first reaches ``target``, linear between evals (the first eval's value where it is
    already there), or None if it never does (or the column was not recorded)."""
    if not math.isfinite(target) or any(len(point) <= column for point in curve):
        return None
    previous: Sequence[float] | None = None
    for point in curve:
        loss = point[1]
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(point[column])
            x0, l0 = previous[column], previous[1]
            return x0 + (l0 - target) / (l0 - loss) * (point[column] - x0)
        previous = point
    return None


def tokens_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Tokens at which the eval loss first reaches ``target`` (see :func:`reach`)."""
    return reach(curve, target, 0)


def wall_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Seconds of timed steps at which the eval loss first reaches ``target``."""
    return reach(curve, target, 2)


def search_seed(results: dict[str, Any]) -> int:
    return int(results.get("seeds", [0])[0])


def best_runs(runs: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per variant (:attr:`Config.name`), its run at ``seed`` with the lowest final eval
    loss (first-seen order)."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs:
        config = config_from(run["config"])
        if config.seed != seed:
            continue
        if config.name not in best or run["score"] < best[config.name]["score"]:
            best[config.name] = run
    return best


def repeats(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The runs with ``run``'s settings, by seed."""
    settings = config_from(run["config"]).settings()
    same = [r for r in runs if config_from(r["config"]).settings() == settings]
    return {config_from(r["config"]).seed: r for r in same}


def unbracketed(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[str]:
    """The swept settings of ``run`` (those its variant's runs gave more than one value)
    that no run of its variant (:attr:`Config.name`), alike in every other setting, tried on
    both sides of: there, a better value may lie outside the sweep."""
    config = config_from(run["config"])
    mine = [c for c in (config_from(r["config"]) for r in runs) if c.name == config.name]
    out = []
    for axis in AXES:
        value = getattr(config, axis)
        if value is None or len({getattr(c, axis) for c in mine}) < 2:
            continue
        others = [getattr(c, axis) for c in mine if c.with_value(axis, value) == config]
        if not (min(others) < value < max(others)):
            out.append(axis.replace("_", "-"))
    return out


def edge_cell(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    """The table's "best at an edge": the unbracketed axes, or "not searched" for a
    variant whose runs all share one setting (say, NorMuon at Muon's best)."""
    name = config_from(run["config"]).name
    settings = {c.settings() for c in (config_from(r["config"]) for r in runs) if c.name == name}
    if len(settings) < 2:
        return "not searched"
    return ", ".join(unbracketed(run, runs)) or "no"


def spread_cell(values: Sequence[float], fmt: Callable[[float], str], unit: str = "") -> str:
    """``median (min–max)`` of ``values`` with ``unit`` after each end, or the one value."""
    if len(values) == 1:
        return fmt(values[0]) + unit
    mid = statistics.median(values)
    return f"{fmt(mid)}{unit} ({fmt(min(values))}–{fmt(max(values))}{unit})"


@dataclass(frozen=True)
class Reached:
    """An optimizer's best settings against AdamW's best, seed by seed."""

    losses: list[float]  # final eval loss at each seed
    tokens: list[float]  # tokens to AdamW's final loss of the same seed
    token_ratios: list[float]
    walls: list[float]  # seconds of timed steps to it
    wall_ratios: list[float]
    no_target: bool  # AdamW has no finite final loss to reach


def reached(name: str, best: dict[str, dict[str, Any]], runs: Sequence[dict[str, Any]]) -> Reached:
    """Per seed the run of ``name``'s best settings has, its tokens and wall time to reach
    AdamW's final eval loss of that seed, and their ratios to AdamW's own."""
    mine = repeats(best[name], runs)
    base = repeats(best[BASELINE], runs) if BASELINE in best else {}
    targets = {seed: r for seed, r in base.items() if math.isfinite(r["score"])}
    out = Reached([mine[s]["score"] for s in sorted(mine)], [], [], [], [], not targets)
    for seed in sorted(set(mine) & set(targets)):
        target = targets[seed]["score"]
        for column, values, ratios in (
            (0, out.tokens, out.token_ratios),
            (2, out.walls, out.wall_ratios),
        ):
            own = reach(targets[seed]["curve"], target, column)
            got = reach(mine[seed]["curve"], target, column)
            if got is not None:
                values.append(got)
                if own:
                    ratios.append(got / own)
    return out


def params_cell(results: dict[str, Any]) -> str:
    params = results.get("params")
    return f"{params / 1e6:.1f}M" if params else "—"


def tokens_per_param(results: dict[str, Any]) -> str:
    params = results.get("params")
    return f"{results['tokens_per_run'] / params:.2f}" if params else "—"


def summary_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """The sweep table's rows: each variant's best settings, over its seeds, against AdamW's
    best of the same seed."""
    runs = results["runs"]
    best = best_runs(runs, search_seed(results))
    rows = []
    for name, run in best.items():
        got = reached(name, best, runs)
        finite = [x for x in got.losses if math.isfinite(x)]
        missing = "no target" if got.no_target else "not reached"
        rows.append(
            {
                "model": results["model"],
                "tokens": f"{results['tokens_per_run'] / 1e6:.1f}M",
                "tokens/param": tokens_per_param(results),
                "optimizer": name,
                "best settings": config_from(run["config"]).label(),
                "seeds": str(len(got.losses)),
                "final eval loss": spread_cell(finite, lambda x: f"{x:.4f}")
                if finite
                else status_of(run),
                "tokens to AdamW's best": spread_cell(got.tokens, lambda x: f"{x / 1e6:.2f}", "M")
                if got.tokens
                else missing,
                "vs AdamW": spread_cell(got.token_ratios, lambda x: f"{x:.3f}", "×")
                if got.token_ratios
                else missing,
                "wall s to AdamW's best": spread_cell(got.walls, lambda x: f"{x:.1f}")
                if got.walls
                else missing,
                "wall vs AdamW": spread_cell(got.wall_ratios, lambda x: f"{x:.3f}", "×")
                if got.wall_ratios
                else missing,
                "runs": str(sum(config_from(r["config"]).name == name for r in runs)),
                "best at an edge": edge_cell(run, runs),
            }
        )
    return rows


def budget_row(results: dict[str, Any]) -> dict[str, str] | None:
    """The budget table's row of this sweep (Muon against AdamW), if it has both."""
    by = {row["optimizer"]: row for row in summary_rows(results)}
    if BASELINE not in by or MUON not in by:
        return None
    return {
        "model": results["model"],
        "parameters": params_cell(results),
        "tokens": by[MUON]["tokens"],
        "tokens/param": by[MUON]["tokens/param"],
        "AdamW final eval loss": by[BASELINE]["final eval loss"],
        "Muon final eval loss": by[MUON]["final eval loss"],
        "Muon's tokens to AdamW's best": by[MUON]["vs AdamW"],
        "Muon's wall time to AdamW's best": by[MUON]["wall vs AdamW"],
        "seeds": by[MUON]["seeds"],
    }


def grid_lines(results: dict[str, Any]) -> list[str]:
    """Every run's final eval loss, grouped by variant, best first."""
    lines = [
        "| optimizer | settings | seed | final eval loss | wall s | data wait ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in sorted(results["runs"], key=lambda r: (config_from(r["config"]).name, r["score"])):
        config = config_from(run["config"])
        score = status_of(run) if math.isinf(run["score"]) else f"{run['score']:.4f}"
        wait = run.get("data_wait_s")
        waited = "—" if wait is None else f"{wait * 1e3:.2f}"
        lines.append(
            f"| {config.name} | {config.label()} | {config.seed} | {score} "
            f"| {run['wall_s']:.0f} | {waited} |"
        )
    return lines


def load(paths: Sequence[Path]) -> dict[str, Any]:
    """The sweeps at ``paths`` as one, or an exit naming the file and what is wrong."""
    parts = []
    for path in paths:
        part = tables.read_results(path, "sweep.py", RESULT_KEYS)
        for index, run in enumerate(part["runs"]):
            missing = [k for k in RUN_KEYS if not isinstance(run, dict) or k not in run]
            if missing:
                raise SystemExit(
                    f"--from-json {path}: run {index} lacks {', '.join(missing)}; give a "
                    "results.json written by benchmarks/sweep.py"
                )
        parts.append((path, part))
    return merged(parts)


def merged(parts: Sequence[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """Sweeps of one model and flags (say, a search and the runs that repeated its best at
    another seed) as one: their runs together, their commands and devices in order."""
    first_path, first = parts[0]
    for path, part in parts[1:]:
        for key in ("model", "flags", "tokens_per_run", "params"):
            if part.get(key) != first.get(key):
                raise SystemExit(
                    f"--from-json {path}: {key} {part.get(key)!r} differs from "
                    f"{first.get(key)!r} in {first_path}; merge only sweeps of one model and flags"
                )
    commands = list(dict.fromkeys(part["run"]["command"] for _, part in parts))
    devices = list(dict.fromkeys(part["run"]["device"] for _, part in parts))
    seeds = sorted({config_from(r["config"]).seed for _, p in parts for r in p["runs"]})
    return {
        **first,
        "seeds": [search_seed(first), *(s for s in seeds if s != search_seed(first))],
        "run": {**first["run"], "command": " && ".join(commands), "device": " + ".join(devices)},
        "runs": [run for _, part in parts for run in part["runs"]],
        "unfinished": [u for _, part in parts for u in part.get("unfinished", [])],
    }


def no_target(results: dict[str, Any]) -> str | None:
    """Why the sweep has no AdamW loss to measure against, or None if it has one."""
    best = best_runs(results["runs"], search_seed(results))
    if BASELINE not in best:
        return "it has no AdamW run at the search seed"
    if math.isinf(best[BASELINE]["score"]):
        return "every AdamW run diverged (try lower --adamw-lrs)"
    return None


def check_record(record: Sequence[str], names: Sequence[str]) -> None:
    """Exit naming a ``--record`` value that is none of the sweep's variants ``names``."""
    for name in record:
        if name not in names:
            raise SystemExit(
                f"--record {name}: this sweep has no variant of that name; give some of "
                f"{', '.join(dict.fromkeys(names))}"
            )


def report(
    results: dict[str, Any],
    logs: Path | None,
    write_table: bool,
    record: Sequence[str] | None = None,
) -> None:
    """Print (and with ``logs``, write) the tables; with ``write_table`` record the rows of
    the variants ``record`` names (all without it) and, if both adamw's and muon's are among
    them, the budget row."""
    rows = summary_rows(results)
    budget = budget_row(results)
    with tempfile.TemporaryDirectory() as scratch:
        tables.store("sweep", rows, results["run"], Path(scratch))
        text = tables.markdown("sweep", Path(scratch))
        if budget is not None:
            tables.store("budget", [budget], results["run"], Path(scratch))
            text += "\n" + tables.markdown("budget", Path(scratch))
    text += "\n" + "\n".join(grid_lines(results)) + "\n"
    if results.get("unfinished"):
        text += f"\nNot run (time budget): {', '.join(results['unfinished'])}\n"
    if logs is not None:
        (logs / "table.md").write_text(text)
        plot(results, logs / "sweep.png")
    print(text, end="")
    if write_table:
        why = no_target(results)
        if why is not None:
            raise SystemExit(f"no target: {why}; nothing recorded in benchmarks/README.md")
        chosen = rows
        if record is not None:
            check_record(record, [row["optimizer"] for row in rows])
            chosen = [row for row in rows if row["optimizer"] in record]
        tables.record("sweep", chosen, results["run"])
        if budget is not None and {BASELINE, MUON} <= {row["optimizer"] for row in chosen}:
            tables.record("budget", [budget], results["run"])
            tables.render("budget", readme=ROOT / "README.md")


def plot(results: dict[str, Any], path: Path) -> None:
    """Each optimizer's best eval curve against tokens, AdamW's best final loss dashed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no sweep.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_runs(results["runs"], search_seed(results))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in best.items():
        if run["curve"]:
            tokens = [point[0] / 1e6 for point in run["curve"]]
            losses = [point[1] for point in run["curve"]]
            label = f"{name} ({config_from(run['config']).label()})"
            ax.plot(tokens, losses, "o-", ms=3, label=label)
    if no_target(results) is None:
        ax.axhline(best[BASELINE]["score"], ls="--", c="gray", lw=1, label="AdamW's best final")
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(f"{results['model']}: each optimizer at its best swept settings", fontsize=10)
    if ax.get_legend_handles_labels()[0]:  # none where every run crashed or diverged
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def defaults_line(results: dict[str, Any]) -> str:
    """examples/defaults.py's ``TEXT = ...`` line with this sweep's best AdamW and Muon
    settings (the other adjust_lr's lr kept); an exit if either is missing or unbracketed."""
    why = no_target(results)
    best = best_runs(results["runs"], search_seed(results))
    if why is not None or MUON not in best:
        raise SystemExit(f"--write-defaults needs AdamW's and Muon's best: {why or 'no Muon run'}")
    for name in (BASELINE, MUON):
        edges = unbracketed(best[name], results["runs"])
        if edges:
            raise SystemExit(
                f"--write-defaults: {name}'s best ({config_from(best[name]['config']).label()}) "
                f"is at an edge of {', '.join(edges)}; run the points past it (--runs) and "
                "merge them with --from-json first"
            )
    sys.path.insert(0, str(DEFAULTS.parent))
    import defaults

    adamw, muon = config_from(best[BASELINE]["config"]), config_from(best[MUON]["config"])
    text = defaults.TEXT
    lrs = dict(text.muon)
    lrs[muon.adjust_lr or defaults.DEFAULT_ADJUST_LR] = muon.lr if muon.lr else lrs[MUON]
    shown = ", ".join(f'"{k}": {v:g}' for k, v in lrs.items())
    arguments = [
        f"{{{shown}}}",
        f"{muon.muon_adamw_lr or text.muon_adamw:g}",
        f"{adamw.adamw_lr or text.adamw:g}",
        f"{text.adamw_dim}",
        f"muon_warmup={text.muon_warmup if muon.warmup is None else muon.warmup}",
        f"adamw_warmup={text.adamw_warmup if adamw.warmup is None else adamw.warmup}",
    ]
    # One argument a line with a trailing comma: the layout ruff format keeps.
    return "TEXT = SweptLrs(\n" + "".join(f"    {a},\n" for a in arguments) + ")"


def write_defaults(results: dict[str, Any], path: Path = DEFAULTS) -> None:
    """Replace the ``TEXT = SweptLrs(...)`` statement of ``path`` (one line, or a block
    ending in a line ``)``) with :func:`defaults_line`'s."""
    new = defaults_line(results)
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, x in enumerate(lines) if x.startswith("TEXT = SweptLrs(")]
    if len(starts) != 1:
        raise SystemExit(
            f"{path} needs exactly one statement starting 'TEXT = SweptLrs(' to replace"
        )
    first = last = starts[0]
    if lines[first].rstrip().endswith("("):
        last = next(i for i in range(first, len(lines)) if lines[i].rstrip() == ")")
    path.write_text("".join([*lines[:first], new + "\n", *lines[last + 1 :]]))
    print(f"{path}:\n{new}")


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
    argv += [*flags, *config.flags(), "--out", str(out), "--no-progress", "--no-plot"]
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
    """The finished run of ``slot``: settings, exit code, eval curve, score, data wait."""
    assert slot.process is not None and slot.config is not None and slot.out is not None
    code = slot.process.wait()
    metrics_path = slot.out / "metrics.jsonl"
    metrics = []
    if metrics_path.is_file():
        metrics = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    curve = eval_curve(metrics)
    waits = [r["data_wait_s"] for r in metrics[1:]]  # the first batch is built at start-up
    log = (slot.out / "train.log").read_text(errors="replace").splitlines()
    run = {
        "config": asdict(slot.config),
        "exit_code": code,
        "status": run_status(metrics, code),
        "wall_s": time.perf_counter() - slot.began,
        "curve": curve,
        "score": final_score(curve, code),
        "data_wait_s": statistics.median(waits) if waits else None,
        "argv": slot.process.args,
        "log_tail": log[-LOG_TAIL:] if code else [],
    }
    slot.process, slot.config, slot.out = None, None, None
    return run


def device_sets(gpus: int, nproc: int) -> list[str | None]:
    """One entry per slot: its CUDA_VISIBLE_DEVICES, or None on a machine without GPUs.
    Under CUDA_VISIBLE_DEVICES the slots split the GPUs it lists."""
    if gpus == 0:
        return [None]
    if gpus % nproc:
        raise SystemExit(f"--gpus {gpus} is not a multiple of --nproc {nproc}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(d) for d in range(gpus)]
    if len(ids) < gpus:
        raise SystemExit(f"--gpus {gpus} but CUDA_VISIBLE_DEVICES={visible} lists {len(ids)}")
    return [",".join(ids[s * nproc : (s + 1) * nproc]) for s in range(gpus // nproc)]


def parameters(parsed: argparse.Namespace) -> int:
    """The example model's parameter count at these flags (built on the meta device)."""
    import torch
    import train
    from model import Transformer

    with torch.device("meta"):
        model = Transformer(train.model_args(parsed))
    return sum(p.numel() for p in model.parameters())


def sweep(args: argparse.Namespace, flags: list[str], fixed: list[Config]) -> dict[str, Any]:
    """Run the planned (or the given) configs on every slot until done or out of budget."""
    parsed = checked_flags(args, flags, fixed)
    planner = None if fixed else Planner(searches_from(args), args.seeds, args.also)
    slots = [Slot(d) for d in device_sets(args.gpus, args.nproc)]
    runs: list[dict[str, Any]] = []
    command = tables.command_line()
    if args.resume_from is not None:
        previous = load([args.resume_from])
        this = {"model": args.model, "flags": flags, "search seed": args.seeds[0]}
        before = {**previous, "search seed": search_seed(previous)}
        for key, mine in this.items():
            if before[key] != mine:
                raise SystemExit(
                    f"--resume-from {args.resume_from}: its {key} {before[key]!r} differs from "
                    f"this sweep's {mine!r}; resume with the same --model, first --seeds and "
                    "training flags"
                )
        runs = list(previous["runs"])
        command = f"{previous['run']['command']} && {command}"
    scores = {config_from(r["config"]): r["score"] for r in runs}
    started = set(scores)
    began = time.perf_counter()
    longest = max((r["wall_s"] for r in runs), default=0.0)  # a resumed sweep's estimate
    unfinished: list[str] = []
    args.logs.mkdir(parents=True, exist_ok=True)
    while True:
        ready = (
            planner.ready(scores, started) if planner else [c for c in fixed if c not in started]
        )
        for slot in slots:
            if slot.process is not None or not ready:
                continue
            if args.budget_s is not None and time.perf_counter() - began + longest > args.budget_s:
                unfinished = [f"{c.optimizer} {c.label()} seed {c.seed}" for c in ready]
                ready = []
                break
            config = ready.pop(0)
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", f"{config.optimizer}_{config.label()}")
            out = args.logs / f"{len(started):02d}_{slug}_s{config.seed}"
            start(slot, args.nproc, config, flags, out)
            started.add(config)
            print(f"started {config.optimizer} {config.label()} seed {config.seed}", flush=True)
        busy = [s for s in slots if s.process is not None]
        if not busy:
            break
        for slot in busy:
            assert slot.process is not None
            if slot.process.poll() is not None:
                run = collect(slot)
                longest = max(longest, run["wall_s"])
                config = config_from(run["config"])
                scores[config] = run["score"]
                runs.append(run)
                print(f"done {describe(run)} ({run['wall_s']:.0f} s)", flush=True)
                if status_of(run) == CRASHED:
                    print(crash_tail(run), flush=True)
        time.sleep(1.0)
    results = {
        "model": args.model,
        "flags": flags,
        "tokens_per_run": parsed.batch_size * parsed.seq_len * parsed.steps,
        "params": parameters(parsed),
        "seeds": list(args.seeds),
        "run": run_info(args, command),
        "runs": runs,
        "unfinished": unfinished,
    }
    (args.logs / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return results


def describe(run: dict[str, Any]) -> str:
    """``optimizer settings seed N: score`` of a finished run (or how it failed)."""
    config = config_from(run["config"])
    status = status_of(run)
    score = f"{run['score']:.4f}" if status == "ok" else status
    return f"{config.optimizer} {config.label()} seed {config.seed}: {score}"


def crash_tail(run: dict[str, Any]) -> str:
    """A crashed run's exit code and the end of its log, indented."""
    lines = [f"    {line}" for line in run.get("log_tail", [])]
    return "\n".join([f"  exit {run['exit_code']}, the end of its log:", *lines])


def crashed(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [run for run in results["runs"] if status_of(run) == CRASHED]


def checked_flags(
    args: argparse.Namespace, flags: list[str], fixed: list[Config]
) -> argparse.Namespace:
    """The training flags, parsed, once every run's flags (each variant's or search's
    optimizer and settings with them) parse as the example will read them, the data files
    exist and ``--logs`` is free: a sweep that cannot run refuses before it starts one."""
    parsed = training_args(flags)
    if parsed.data is None:
        raise SystemExit("a sweep scores the eval loss on held-out text: give --data")
    per_run = ["--seed", "--optimizer", "--momentum-dtype"] + ([] if fixed else ["--warmup"])
    for flag in per_run:
        if any(f == flag or f.startswith(flag + "=") for f in flags):
            fix = "leave it out"
            if flag == "--momentum-dtype":
                fix = 'put it in the variant instead (--runs "muon ... --momentum-dtype bf16")'
            raise SystemExit(f"{flag} after -- is set by the sweep for each run: {fix}")
    firsts = [s.base for s in searches_from(args)] if not fixed else fixed
    also = [replace(c, optimizer=name) for c in firsts if c.name == MUON for name in args.also]
    for config in [*firsts, *also]:
        training_args([*flags, *config.flags()])
    check_data(parsed)
    check_fresh(args.logs, "--logs")
    return parsed


def run_info(args: argparse.Namespace, command: str) -> dict[str, str]:
    """This machine's run info; a resumed sweep names the devices of both parts."""
    info = tables.run_info(gpus=max(1, args.gpus), command=command)
    if args.resume_from is not None:
        before = load([args.resume_from])["run"]["device"]
        if before != info["device"]:
            info["device"] = f"{before} + {info['device']}"
    return info


def config_of(variant: str) -> Config:
    """``"muon --lr 0.02 --warmup 30"`` as a :class:`Config`; ``--momentum-dtype fp32`` is
    the example's default, so it is the same config (and name) as no flag."""
    optimizer, *extra = shlex.split(variant)
    p = argparse.ArgumentParser(prog=f"--runs {variant!r}", add_help=False)
    p.add_argument("--lr", type=float)
    p.add_argument("--adjust-lr")
    p.add_argument("--muon-adamw-lr", type=float)
    p.add_argument("--adamw-lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--momentum-dtype", choices=("fp32", "bf16"))
    values = vars(p.parse_args(extra))
    dtype = values.pop("momentum_dtype")
    if dtype is not None and optimizer == BASELINE:
        p.error(
            f"--momentum-dtype {dtype}: the adamw variant keeps no Muon momenta (train.py "
            "ignores it there); leave it out of this variant"
        )
    return Config(optimizer, momentum_dtype=None if dtype == "fp32" else dtype, **values)


def fixed_configs(args: argparse.Namespace) -> list[Config]:
    """``--runs`` or ``--best-of``'s settings at each seed, seed by seed."""
    if args.best_of is not None:
        done = load([args.best_of])
        variants = [
            config_from(r["config"]).settings()
            for r in best_runs(done["runs"], search_seed(done)).values()
            if math.isfinite(r["score"])
        ]
    else:
        variants = [config_of(v) for v in args.runs or []]
    return [replace(c, seed=seed) for seed in args.seeds for c in variants]


def searches_from(args: argparse.Namespace) -> list[Search]:
    """AdamW's and Muon's searches from the flags' starting points."""
    adamw_axes = {"adamw_lr": args.adamw_lrs, "warmup": args.adamw_warmups}
    muon_axes: dict[str, list[float]] = {"lr": args.muon_lrs, "warmup": args.muon_warmups}
    if len(args.muon_adamw_lrs) > 1:
        muon_axes["muon_adamw_lr"] = args.muon_adamw_lrs
    out = []
    for name, axes, extra in (
        (BASELINE, adamw_axes, {}),
        (MUON, muon_axes, {"adjust_lr": args.adjust_lr, "muon_adamw_lr": args.muon_adamw_lrs[0]}),
    ):
        base = Config(name, seed=args.seeds[0], **extra)
        for axis, points in axes.items():
            base = base.with_value(axis, points[0])
        out.append(Search(base, dict(axes), args.ratio, args.grow, args.passes))
    return out


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Refuse a sweep that cannot give a table, before it trains."""
    lists = ("adamw_lrs", "adamw_warmups", "muon_lrs", "muon_warmups", "muon_adamw_lrs")
    for name in lists:
        values = getattr(args, name)
        if min(values) <= 0:
            p.error(f"--{name.replace('_', '-')} {values}: every value must be > 0 (log scale)")
    if args.gpus < 0 or args.nproc < 1:
        p.error(f"--gpus {args.gpus} must be >= 0 (0: the CPU) and --nproc {args.nproc} >= 1")
    if args.budget_s is not None and args.budget_s <= 0:
        p.error(f"--budget-s {args.budget_s} must be > 0 seconds (leave it out: no budget)")
    if args.ratio <= 1:
        p.error(f"--ratio {args.ratio} must be > 1: the step between a line's points")
    if args.passes < 1 or args.grow < 0:
        p.error("--passes must be >= 1 and --grow >= 0")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error(f"--seeds {args.seeds} must be distinct and >= 0")
    if args.runs and args.best_of:
        p.error("--runs and --best-of both name the runs: give one")
    if args.resume_from is not None and args.from_json is not None:
        p.error("--resume-from continues a sweep: it trains, so it takes no --from-json")
    if args.record is not None and not args.write_table:
        names = " ".join(args.record)
        p.error(f"--record {names} picks the rows that --write-table records: give --write-table")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: one run at a time on CPU)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) per run")
    p.add_argument("--model", default="", help="the table's model column, e.g. its size")
    p.add_argument("--logs", type=Path, default=Path("runs/sweep"))
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no run that would end later (seconds)"
    )
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[2.5e-4, 1.25e-4, 5e-4])
    p.add_argument("--adamw-warmups", type=int, nargs="+", default=[60, 30, 120])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.005, 0.02])
    p.add_argument("--muon-warmups", type=int, nargs="+", default=[30, 15, 60])
    p.add_argument(
        "--muon-adamw-lrs",
        type=float,
        nargs="+",
        default=[1e-3],
        help="Muon's AdamW part: one value is held; more are searched as a third axis",
    )
    p.add_argument("--adjust-lr", default="spectral_norm", help="Muon's adjust_lr (held)")
    p.add_argument("--ratio", type=float, default=2.0, help="step between a line's points")
    p.add_argument("--grow", type=int, default=2, help="points a line may add past its edges")
    p.add_argument("--passes", type=int, default=2, help="lines per axis at most")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="the search runs at the first; each best (or each --runs variant) at the others",
    )
    p.add_argument("--also", nargs="*", default=[], help="rules run once at Muon's best")
    p.add_argument("--runs", nargs="+", default=None, help="train these variants, no search")
    p.add_argument(
        "--best-of", type=Path, default=None, help="train the bests of this results.json"
    )
    p.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="a finished sweep's results.json: keep its runs and run what it left (the rest of"
        " the search, the repeats at new --seeds)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="report finished sweeps again; several of the same model and flags as one",
    )
    p.add_argument("--plot", type=Path, default=None, help="with --from-json: write the plot")
    p.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    p.add_argument(
        "--record",
        nargs="+",
        default=None,
        metavar="NAME",
        help="with --write-table: record only these variants' rows (say, muon-bf16m beside a"
        " fuller search's adamw and muon); the budget row only with both adamw and muon",
    )
    p.add_argument(
        "--write-defaults",
        action="store_true",
        help="with --from-json: the bests become examples/defaults.py's --data defaults",
    )
    args = p.parse_args(own)
    check(args, p)
    if args.from_json is not None:
        results = load(args.from_json)
        report(results, None, args.write_table, args.record)
        if args.plot is not None:
            plot(results, args.plot)
        if args.write_defaults:
            write_defaults(results)
        return
    if args.write_defaults:
        p.error("--write-defaults reads a finished sweep: give --from-json")
    fixed = fixed_configs(args)
    if args.record is not None:  # a typo refused before the runs, not after them
        check_record(args.record, [c.name for c in fixed] or [BASELINE, MUON, *args.also])
    results = sweep(args, flags, fixed)
    report(results, args.logs, args.write_table, args.record)
    failed = crashed(results)
    if failed:
        raise SystemExit(
            f"{len(failed)} run(s) crashed (not diverged: they stopped without a non-finite "
            f"loss): {'; '.join(describe(r) for r in failed)}; their logs are under "
            f"{args.logs} (results.json has each log's end)"
        )


if __name__ == "__main__":
    main()
