"""benchmarks/sweep.py: the search brackets each optimizer's best lr and warmup, the scores
(tokens and wall time to AdamW's best, over seeds) are read from the runs' own curves, bad
input is refused by name; plus one tiny sweep of real runs on the CPU."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from repo_paths import ROOT
from train_launch import launch_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import sweep
from sweep import Config, Planner, Search

# Where each synthetic bowl has its minimum: AdamW's lr below every starting point and its
# warmup above (both lines must grow), Muon's inside.
OPTIMA = {"adamw": (6e-5, 200), "muon": (0.03, 20)}


def bowl(config: Config) -> float:
    """A convex score in log-lr and log-warmup with an lr-warmup interaction (a longer
    warmup moves the best lr up), lowest for Muon; NorMuon a little lower still."""
    lr_opt, warmup_opt = OPTIMA["adamw" if config.optimizer == "adamw" else "muon"]
    lr = config.adamw_lr if config.optimizer == "adamw" else config.lr
    assert lr is not None and config.warmup is not None
    w = math.log(config.warmup / warmup_opt)
    x = math.log(lr / lr_opt) - 0.3 * w
    offset = {"adamw": 3.0, "muon": 2.0, "normuon": 1.9}[config.optimizer]
    return offset + x**2 + 0.5 * w**2 + 0.01 * config.seed


def searches(grow: int = 3, passes: int = 4) -> list[Search]:
    adamw = Search(
        Config("adamw", adamw_lr=2.5e-4, warmup=60),
        {"adamw_lr": [2.5e-4, 1.25e-4, 5e-4], "warmup": [60, 30, 120]},
        grow=grow,
        passes=passes,
    )
    muon = Search(
        Config("muon", lr=0.01, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=30),
        {"lr": [0.01, 0.005, 0.02], "warmup": [30, 15, 60]},
        grow=grow,
        passes=passes,
    )
    return [adamw, muon]


def run_planner(planner: Planner, parallel: int) -> dict[Config, float]:
    """Drive the planner as the sweep does, ``parallel`` runs at a time."""
    scores: dict[Config, float] = {}
    started: set[Config] = set()
    for _ in range(500):
        ready = planner.ready(scores, started)[:parallel]
        if not ready:
            break
        for config in ready:
            started.add(config)
            scores[config] = bowl(config)
    assert planner.finished(scores, started)
    return scores


def bracketed(scores: dict[Config, float], best: Config, axis: str) -> bool:
    value = getattr(best, axis)
    line = [getattr(c, axis) for c in scores if c.with_value(axis, value) == best]
    return min(line) < value < max(line)


@pytest.mark.parametrize("parallel", [1, 4])
def test_the_search_brackets_every_best_on_lr_and_warmup(parallel: int) -> None:
    planner = Planner(searches(), seeds=[0, 1], also=["normuon"])
    scores = run_planner(planner, parallel)
    for name, lr_axis in (("adamw", "adamw_lr"), ("muon", "lr")):
        searched = [c for c in scores if c.optimizer == name and c.seed == 0]
        best = min(searched, key=scores.__getitem__)
        assert bracketed(scores, best, lr_axis) and bracketed(scores, best, "warmup"), best
        # Every neighbour one step along an axis scored no better: a local best of the grid.
        for axis in (lr_axis, "warmup"):
            for factor in (0.5, 2.0):
                near = best.with_value(axis, getattr(best, axis) * factor)
                assert scores.get(near, math.inf) >= scores[best]
        # The best alone ran again at seed 1; NorMuon once at Muon's best.
        assert [c for c in scores if c.optimizer == name and c.seed == 1] == [replace(best, seed=1)]
        if name == "muon":
            normuon = [c for c in scores if c.optimizer == "normuon"]
            assert normuon == [replace(best, optimizer="normuon")]
    # AdamW's optimum lay outside the starting points on both axes: the lines grew to it.
    adamw = min((c for c in scores if c.optimizer == "adamw"), key=scores.__getitem__)
    assert adamw.adamw_lr is not None and adamw.adamw_lr < 1.25e-4
    assert adamw.warmup is not None and adamw.warmup > 120


def test_lines_stop_at_their_limits() -> None:
    """A line grows at most ``grow`` points and an axis gets at most ``passes`` lines; the
    table then names the edge."""
    (adamw, _) = searches(grow=1, passes=1)
    scores = run_planner(Planner([adamw]), 4)
    lrs = sorted({c.adamw_lr for c in scores})
    warmups = sorted({c.warmup for c in scores})
    assert lrs == [6.25e-5, 1.25e-4, 2.5e-4, 5e-4]  # one point grown below the start
    assert warmups == [30, 60, 120, 240]
    assert len([line for line in adamw.lines if line.axis == "warmup"]) == 1
    runs = [{"config": c.__dict__, "score": s} for c, s in scores.items()]
    best = sweep.best_runs(runs)["adamw"]
    assert sweep.unbracketed(best, runs) == ["adamw-lr", "warmup"]


def test_a_diverged_search_stops_without_repeats() -> None:
    (adamw, _) = searches()
    planner = Planner([adamw], seeds=[0, 1])
    scores: dict[Config, float] = {}
    started: set[Config] = set()
    while ready := planner.ready(scores, started):
        for config in ready:
            started.add(config)
            scores[config] = math.inf
    assert len(scores) == 3 and all(c.seed == 0 for c in scores)


def test_reach_interpolates_tokens_and_wall_time_between_evals() -> None:
    curve = [(100, 5.0, 10.0), (200, 4.0, 30.0), (300, 3.0, 40.0)]
    assert sweep.tokens_to_reach(curve, 3.5) == pytest.approx(250.0)
    assert sweep.wall_to_reach(curve, 3.5) == pytest.approx(35.0)
    assert sweep.tokens_to_reach(curve, 5.5) == 100.0
    assert sweep.tokens_to_reach(curve, 2.9) is None
    assert sweep.tokens_to_reach(curve, math.inf) is None
    assert sweep.wall_to_reach([(100, 5.0), (200, 4.0)], 4.5) is None  # no elapsed recorded
    assert sweep.final_score(curve, 0) == 3.0
    assert math.isinf(sweep.final_score(curve, 1))
    assert math.isinf(sweep.final_score([(100, math.nan, 1.0)], 0))


def linear_run(config: Config, start: float, slope: float, speed: float) -> dict[str, Any]:
    """A run whose eval loss falls linearly in tokens (``start - slope * tokens``) and whose
    timed steps take ``1 / speed`` seconds a token."""
    curve = [(t, start - slope * t, t / speed) for t in range(1000, 10001, 1000)]
    return {"config": config.__dict__, "score": curve[-1][1], "curve": curve, "wall_s": 1.0}


def synthetic(adamw_seeds: dict[int, float], muon_seeds: dict[int, float]) -> dict[str, Any]:
    """AdamW (slope 1e-4, 2 tokens a second) against Muon (its own slopes, 1 token a second)
    at several seeds, plus a worse AdamW lr at seed 0. Every curve starts at 3.0."""
    adamw = Config("adamw", adamw_lr=2.5e-4, warmup=60)
    muon = Config("muon", lr=0.01, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=30)
    runs = [linear_run(Config("adamw", adamw_lr=1e-3, warmup=60), 3.0, 0.5e-4, 2.0)]
    runs += [linear_run(replace(adamw, seed=s), 3.0, k, 2.0) for s, k in adamw_seeds.items()]
    runs += [linear_run(replace(muon, seed=s), 3.0, k, 1.0) for s, k in muon_seeds.items()]
    return {
        "model": "tiny",
        "flags": [],
        "tokens_per_run": 10000,
        "params": 5000,
        "seeds": [0, 1],
        "run": {"device": "CPU", "torch": "x", "triton": "none", "date": "d", "command": "c"},
        "runs": runs,
    }


def numbers(cell: str) -> list[float]:
    """``"0.625× (0.500–0.750×)"`` -> ``[0.625, 0.5, 0.75]``."""
    return [float(x) for x in re.findall(r"\d+\.?\d*", cell)]


def test_summary_gives_tokens_and_wall_time_to_adamws_best_over_seeds() -> None:
    adamw_slopes, muon_slopes = {0: 1e-4, 1: 1.1e-4}, {0: 2e-4, 1: 2.5e-4}
    rows = {
        row["optimizer"]: row for row in sweep.summary_rows(synthetic(adamw_slopes, muon_slopes))
    }
    # AdamW at seed s ends at 3 - k_s * 10000; Muon (slope m_s) reaches it at tokens
    # k_s * 10000 / m_s, in that many seconds (1 token/s), AdamW in 10000 / 2 seconds.
    tokens = {s: adamw_slopes[s] * 10000 / muon_slopes[s] for s in (0, 1)}
    token_ratios = sorted(t / 10000 for t in tokens.values())
    wall_ratios = sorted(t / 5000 for t in tokens.values())
    muon, adamw = rows["muon"], rows["adamw"]
    assert muon["seeds"] == adamw["seeds"] == "2"
    # Cells: the median over seeds (of two, their mean) and the min–max.
    assert numbers(muon["vs AdamW"]) == pytest.approx(
        [sum(token_ratios) / 2, *token_ratios], abs=1e-3
    )
    assert numbers(muon["wall vs AdamW"]) == pytest.approx(
        [sum(wall_ratios) / 2, *wall_ratios], abs=1e-3
    )
    assert adamw["vs AdamW"] == adamw["wall vs AdamW"] == "1.000× (1.000–1.000×)"
    assert muon["tokens/param"] == f"{10000 / 5000:.2f}"
    assert adamw["best settings"] == "adamw-lr 0.00025 warmup 60"  # the better of two lrs
    budget = sweep.budget_row(synthetic(adamw_slopes, muon_slopes))
    assert budget is not None and budget["Muon's tokens to AdamW's best"] == muon["vs AdamW"]


def test_a_diverged_baseline_is_no_target_and_is_never_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = synthetic({0: 1e-4}, {0: 2e-4})
    for run in results["runs"]:
        if run["config"]["optimizer"] == "adamw":
            run["score"] = math.inf
    rows = {row["optimizer"]: row for row in sweep.summary_rows(results)}
    for column in ("tokens to AdamW's best", "vs AdamW", "wall s to AdamW's best"):
        assert rows["muon"][column] == "no target", column
    recorded: list[str] = []
    monkeypatch.setattr(sweep.tables, "record", lambda name, *a, **k: recorded.append(name))
    monkeypatch.setattr(sweep.tables, "render", lambda name, *a, **k: recorded.append(name))
    with pytest.raises(SystemExit, match="no target: every AdamW run diverged"):
        sweep.report(results, None, write_table=True)
    assert recorded == []


def driver(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), *args]
    return subprocess.run(argv, env=launch_env(), capture_output=True, text=True, timeout=600)


def test_from_json_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"model": "tiny", "runs": [{"config"')
    table = tmp_path / "train_table.json"
    table.write_text(json.dumps({"model": "m", "nproc": 4, "summary": {}, "runs": []}))
    bad_run = tmp_path / "bad_run.json"
    results = synthetic({0: 1e-4}, {0: 2e-4})
    del results["runs"][1]["curve"]
    bad_run.write_text(json.dumps(results))
    for path, problem in (
        (truncated, "not valid JSON"),
        (table, "lacks flags, tokens_per_run, run"),
        (bad_run, "run 1 lacks curve"),
    ):
        done = driver("--from-json", str(path))
        assert done.returncode != 0
        assert f"--from-json {path}: " in done.stderr and problem in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_bests_become_the_examples_defaults(tmp_path: Path) -> None:
    results = synthetic({0: 1e-4}, {0: 2e-4})
    base = results["runs"]
    # Points on both sides of each best, alike in every other setting: bracketed.
    for config in [
        Config("adamw", adamw_lr=1.25e-4, warmup=60),
        Config("adamw", adamw_lr=2.5e-4, warmup=30),
        Config("adamw", adamw_lr=2.5e-4, warmup=120),
        Config("muon", lr=0.005, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=30),
        Config("muon", lr=0.02, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=30),
        Config("muon", lr=0.01, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=15),
        Config("muon", lr=0.01, adjust_lr="spectral_norm", muon_adamw_lr=1e-3, warmup=60),
    ]:
        base.append(linear_run(config, 3.0, 0.1e-4, 1.0))
    target = tmp_path / "defaults.py"
    target.write_text((ROOT / "examples" / "defaults.py").read_text())
    sweep.write_defaults(results, target)
    namespace: dict[str, Any] = {}
    exec(compile(target.read_text(), str(target), "exec"), namespace)
    text = namespace["TEXT"]
    assert (text.adamw, text.adamw_warmup) == (2.5e-4, 60)
    assert (text.muon["spectral_norm"], text.muon_adamw, text.muon_warmup) == (0.01, 1e-3, 30)
    # Written again over its own block, and kept as is by the formatter.
    sweep.write_defaults(results, target)
    assert target.read_text().count("TEXT = SweptLrs(") == 1
    config = str(ROOT / "pyproject.toml")
    ruff = [sys.executable, "-m", "ruff", "format", "--check", "--config", config, str(target)]
    check = subprocess.run(ruff, capture_output=True)
    assert check.returncode == 0, check.stdout
    # Unbracketed: refused, naming the axis.
    results["runs"] = [r for r in base if r["config"].get("warmup") != 120]
    with pytest.raises(SystemExit, match=r"adamw's best .* edge of warmup"):
        sweep.defaults_line(results)


def test_best_of_and_seeds_give_the_runs_to_repeat(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic({0: 1e-4, 1: 1e-4}, {0: 2e-4})))
    args = sweep_args("--best-of", str(path), "--seeds", "1", "2")
    configs = sweep.fixed_configs(args)
    assert [(c.optimizer, c.seed) for c in configs] == [
        ("adamw", 1), ("muon", 1), ("adamw", 2), ("muon", 2),
    ]  # fmt: skip
    assert configs[0].settings() == Config("adamw", adamw_lr=2.5e-4, warmup=60)


def sweep_args(*argv: str) -> Any:
    """The parsed own flags of sweep.py (its parser, without launching)."""
    captured: dict[str, Any] = {}

    def fake(args: Any, flags: list[str], fixed: list[Config]) -> dict[str, Any]:
        captured["args"] = args
        raise SystemExit(0)

    original = sweep.sweep
    sweep.sweep = fake
    try:
        with pytest.raises(SystemExit):
            sweep.main([*argv, "--", "--data", "x"])
    finally:
        sweep.sweep = original
    return captured["args"]


def test_slots_take_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,6,7")
    assert sweep.device_sets(2, 1) == ["2", "3"]
    assert sweep.device_sets(4, 2) == ["2,3", "6,7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert sweep.device_sets(2, 1) == ["0", "1"]


TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"]
TINY += ["--batch-size", "4", "--steps", "6", "--eval-every", "3", "--eval-batches", "1"]


def test_a_fixed_sweep_trains_and_scores_real_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sweep.main() runs here, its two runs in processes of their own (with launch_env()'s
    # settings; sweep.py puts the repository on PYTHONPATH): a driver process would import
    # torch again only to count the model's parameters.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    logs = tmp_path / "logs"
    sweep.main(
        [
            "--logs", str(logs), "--model", "tiny",
            "--runs", "adamw --adamw-lr 3e-3 --warmup 2", "muon --lr 0.02",
            "--", "--data", str(text), *TINY,
        ]
    )  # fmt: skip
    results = json.loads((logs / "results.json").read_text())
    assert sorted(r["config"]["optimizer"] for r in results["runs"]) == ["adamw", "muon"]
    assert results["params"] > 0
    for run in results["runs"]:
        assert run["exit_code"] == 0
        metrics_path = Path(run["argv"][run["argv"].index("--out") + 1]) / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        # The curve is the evals' tokens, losses and the timed steps' seconds so far.
        evals = [m for m in metrics if "eval_loss" in m]
        assert run["curve"] == [[m["tokens"], m["eval_loss"], m["elapsed"]] for m in evals]
        assert [m["step"] for m in evals] == [3, 6]
        assert run["score"] == run["curve"][-1][1]
        assert run["data_wait_s"] >= 0.0
        warmup = run["config"]["warmup"]
        factors = [m["lr_factor"] for m in metrics[:2]]
        if warmup == 2:
            assert factors == [0.5, 1.0]
    rows = {row["optimizer"]: row for row in sweep.summary_rows(results)}
    assert set(rows) == {"adamw", "muon"}
    assert rows["adamw"]["best settings"] == "adamw-lr 0.003 warmup 2"
    assert "| adamw |" in (logs / "table.md").read_text()


class Finished:
    """A stand-in for a run's process that has already exited."""

    def __init__(self, argv: list[str]) -> None:
        self.args = argv

    def poll(self) -> int:
        return 0


def fake_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> dict[str, Any]:
    """sweep.py's own flags ``argv`` run with every launch replaced by a bowl score."""

    def start(slot: Any, nproc: int, config: Config, flags: Any, out: Path) -> None:
        slot.process, slot.config, slot.out = Finished([str(out)]), config, out

    def collect(slot: Any) -> dict[str, Any]:
        config, slot.process, slot.config = slot.config, None, None
        score = bowl(config)
        curve = [[100, score + 1.0, 1.0], [200, score, 2.0]]
        return {"config": config.__dict__, "score": score, "curve": curve, "wall_s": 0.0}

    monkeypatch.setattr(sweep, "start", start)
    monkeypatch.setattr(sweep, "collect", collect)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    logs = tmp_path / "logs"
    data = _text(tmp_path.parent)  # one file for the sweeps of a test: their flags match
    sweep.main([*argv, "--logs", str(logs), "--model", "tiny", "--", "--data", str(data), *TINY])
    return json.loads((logs / "results.json").read_text())


def _text(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    return text


def test_a_resumed_sweep_runs_what_the_first_part_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A search cut short (its first 5 runs kept), resumed with a second seed: it ends with
    the uninterrupted search's runs plus the repeats, the first part's runs kept as they were."""
    whole = fake_sweep(monkeypatch, tmp_path / "whole")
    part = {**whole, "runs": whole["runs"][:5]}
    first = tmp_path / "first.json"
    first.write_text(json.dumps(part))
    resumed = fake_sweep(
        monkeypatch, tmp_path / "resumed", "--resume-from", str(first), "--seeds", "0", "1"
    )
    assert resumed["runs"][:5] == part["runs"]
    configs = [sweep.config_from(r["config"]) for r in resumed["runs"]]
    assert len(set(configs)) == len(configs), "a run was trained twice"
    searched = {c for c in configs if c.seed == 0}
    assert searched == {sweep.config_from(r["config"]) for r in whole["runs"]}
    bests = sweep.best_runs(resumed["runs"])
    assert {c for c in configs if c.seed == 1} == {
        replace(sweep.config_from(r["config"]), seed=1) for r in bests.values()
    }
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**part, "model": "another"}))
    with pytest.raises(SystemExit, match=r"--resume-from .*other.json: its model 'another'"):
        fake_sweep(monkeypatch, tmp_path / "again", "--resume-from", str(other))


FAKE_TRAIN = """
import json, sys
from pathlib import Path

argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
if argv[argv.index("--optimizer") + 1] == "adamw":
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: rank 1: data file x.bin shrank while the job ran", file=sys.stderr)
    sys.exit(1)
record = {"step": 1, "loss": float("nan"), "tokens": 1, "elapsed": 0.1, "data_wait_s": 0.0}
(out / "metrics.jsonl").write_text(json.dumps(record) + "\\n")
sys.exit(1)
"""


def test_a_crashed_run_is_reported_as_crashed_with_its_log_and_fails_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs that both exit 1: AdamW's without a loss (a crash: its log's end is shown and
    kept, and the sweep exits non-zero), Muon's after logging a NaN loss (a divergence)."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "SCRIPT", script)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    logs = tmp_path / "logs"
    argv = ["--logs", str(logs), "--model", "tiny", "--runs", "adamw", "muon --lr 0.02"]
    with pytest.raises(SystemExit) as failed:
        sweep.main([*argv, "--", "--data", str(_text(tmp_path)), *TINY])
    message = str(failed.value.code)
    assert message.startswith("1 run(s) crashed") and "adamw" in message and "muon" not in message
    results = json.loads((logs / "results.json").read_text())
    status = {r["config"]["optimizer"]: r["status"] for r in results["runs"]}
    assert status == {"adamw": "crashed", "muon": "diverged"}
    (adamw,) = [r for r in results["runs"] if r["config"]["optimizer"] == "adamw"]
    assert any("data file x.bin shrank" in line for line in adamw["log_tail"])
    printed = capsys.readouterr().out
    assert "data file x.bin shrank" in printed and "adamw defaults seed 0: crashed" in printed
    table = (logs / "table.md").read_text()
    assert "| crashed |" in table and "| diverged |" in table


@pytest.mark.parametrize(
    ("own", "training", "named"),
    [
        (["--gpus", "-1"], [], "--gpus -1"),
        (["--nproc", "0"], [], "--nproc 0"),
        (["--budget-s", "-5"], [], "--budget-s -5.0"),
        (["--runs", "sgd --lr 0.1"], [], "'sgd'"),
        (["--also", "sgd"], [], "'sgd'"),
        ([], ["--data", "missing_*.bin"], "--data 'missing_*.bin' matches no file"),
        ([], ["--eval-data", "missing_*.bin"], "--eval-data 'missing_*.bin' matches no file"),
        (["--runs", "muon --momentum-dtype fp16"], [], "invalid choice: 'fp16'"),
        (
            ["--runs", "adamw --momentum-dtype bf16"],
            [],
            "'adamw --momentum-dtype bf16': error: --momentum-dtype bf16: the adamw variant",
        ),
        ([], ["--momentum-dtype", "bf16"], "--momentum-dtype after -- is set by the sweep"),
        (["--runs", "muon"], ["--momentum-dtype=bf16"], "put it in the variant"),
        (["--record", "muon-bf16m"], [], "--record muon-bf16m picks the rows"),
        (
            ["--runs", "adamw", "muon", "--write-table", "--record", "muon-bf16"],
            [],
            "--record muon-bf16: this sweep has no variant of that name; give some of adamw, muon",
        ),
    ],
)
def test_bad_input_is_refused_before_any_run_or_folder(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    own: list[str],
    training: list[str],
    named: str,
) -> None:
    monkeypatch.setattr(sweep, "start", lambda *a: pytest.fail("a run was started"))
    logs = tmp_path / "logs"
    data = ["--data", str(_text(tmp_path / "corpus"))]
    argv = ["--logs", str(logs), "--model", "tiny", *own, "--", *data, *TINY, *training]
    with pytest.raises(SystemExit) as refused:
        sweep.main(argv)
    message = f"{refused.value.code}\n{capsys.readouterr().err}"
    assert refused.value.code not in (0, None), message
    assert named in message, message
    assert not logs.exists(), "a refused sweep left its --logs folder"


def test_a_used_logs_folder_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep, "start", lambda *a: pytest.fail("a run was started"))
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "results.json").write_text("{}")
    argv = ["--logs", str(logs), "--model", "tiny", "--runs", "adamw"]
    with pytest.raises(SystemExit, match=f"--logs {logs} already exists"):
        sweep.main([*argv, "--", "--data", str(_text(tmp_path)), *TINY])
    assert (logs / "results.json").read_text() == "{}"


BF16 = "muon --lr 0.005 --adjust-lr spectral_norm --muon-adamw-lr 0.001 --warmup 30"
BF16 += " --momentum-dtype bf16"


@pytest.mark.parametrize(
    "variant", [BF16, "normuon --lr 0.02 --momentum-dtype bf16", "adamw --adamw-lr 0.0005"]
)
def test_a_variant_round_trips_through_its_flags_and_results_json(variant: str) -> None:
    config = sweep.config_of(variant)
    assert shlex.join(config.flags()[1:]) == variant
    assert sweep.config_from(json.loads(json.dumps(asdict(config)))) == config
    # The example reads the flags as the variant meant them.
    parsed = sweep.training_args(config.flags())
    assert parsed.momentum_dtype == ("bf16" if config.momentum_dtype else "fp32")
    assert ("momentum-dtype bf16" in config.label()) == (config.momentum_dtype == "bf16")


def test_fp32_momenta_are_the_default_config_and_old_results_read_as_fp32() -> None:
    plain = sweep.config_of("muon --lr 0.01")
    assert sweep.config_of("muon --lr 0.01 --momentum-dtype fp32") == plain
    assert plain.name == "muon" and "--momentum-dtype" not in plain.flags()
    assert sweep.config_of("muon --lr 0.01 --momentum-dtype bf16").name == "muon-bf16m"
    older = {k: v for k, v in asdict(plain).items() if k != "momentum_dtype"}
    assert sweep.config_from(older) == plain


def with_bf16(results: dict[str, Any], slopes: dict[float, float]) -> dict[str, Any]:
    """``results`` plus bf16-momenta Muon runs at seed 0, one per lr of ``slopes`` (each
    falling linearly at its slope, as :func:`synthetic`'s Muon does)."""
    bf16 = sweep.config_of(BF16)
    runs = [linear_run(replace(bf16, lr=lr), 3.0, k, 1.0) for lr, k in slopes.items()]
    return {**results, "runs": [*results["runs"], *runs]}


def test_bf16_momenta_are_a_variant_of_their_own() -> None:
    """A bf16 run does not compete with fp32 Muon: each has its best, row, run count and
    bracketing check on its own runs; the budget row stays fp32 Muon's."""
    muon_slope = 2e-4
    slopes = {0.005: 2.2e-4, 0.01: 2.6e-4, 0.02: 2.4e-4}  # every one beats fp32 Muon
    results = with_bf16(synthetic({0: 1e-4}, {0: muon_slope}), slopes)
    best = sweep.best_runs(results["runs"])
    assert list(best) == ["adamw", "muon", "muon-bf16m"]
    assert best["muon"]["config"]["momentum_dtype"] is None
    assert best["muon-bf16m"]["config"]["lr"] == max(slopes, key=slopes.__getitem__)
    rows = {row["optimizer"]: row for row in sweep.summary_rows(results)}
    assert rows["muon"]["runs"] == "1" and rows["muon"]["best at an edge"] == "not searched"
    assert rows["muon-bf16m"]["runs"] == str(len(slopes))
    assert rows["muon-bf16m"]["best at an edge"] == "no"  # bracketed by its own lrs
    assert rows["muon-bf16m"]["best settings"].endswith("momentum-dtype bf16")
    assert float(rows["muon"]["final eval loss"]) == pytest.approx(3.0 - muon_slope * 10000)
    budget = sweep.budget_row(results)
    assert budget is not None
    assert budget["Muon final eval loss"] == rows["muon"]["final eval loss"]
    assert any(line.startswith("| muon-bf16m | lr 0.01 ") for line in sweep.grid_lines(results))
    # Its best at the top of its lr line is at an edge, whatever fp32 Muon tried.
    edge = with_bf16(synthetic({0: 1e-4}, {0: muon_slope}), {0.005: 2.2e-4, 0.01: 2.4e-4})
    rows = {row["optimizer"]: row for row in sweep.summary_rows(edge)}
    assert rows["muon-bf16m"]["best at an edge"] == "lr"


def test_a_runs_sweep_of_both_momentum_dtypes_trains_each_as_its_own_variant(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lrs = ("0.005", "0.01", "0.02")
    bf16 = [f"muon --lr {lr} --warmup 30 --momentum-dtype bf16" for lr in lrs]
    runs = ["adamw --adamw-lr 5e-4 --warmup 60", "muon --lr 0.01 --warmup 30", *bf16]
    results = fake_sweep(monkeypatch, tmp_path, "--runs", *runs)
    configs = [sweep.config_from(r["config"]) for r in results["runs"]]
    assert sorted(c.name for c in configs) == ["adamw", "muon", *["muon-bf16m"] * len(lrs)]
    rows = {row["optimizer"]: row for row in sweep.summary_rows(results)}
    # The bowl's best Muon lr lies above the three: the bf16 line's top is its best, an edge.
    assert rows["muon-bf16m"]["best settings"] == "lr 0.02 warmup 30 momentum-dtype bf16"
    assert rows["muon-bf16m"]["best at an edge"] == "lr"
    assert rows["muon"]["best settings"] == "lr 0.01 warmup 30"


def test_record_stores_only_the_named_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--record muon-bf16m`` adds that row beside a fuller search's adamw and muon rows of
    the same model and tokens, which keep their own run; the budget row needs both."""
    stored = tmp_path / "results"
    rendered: list[str] = []
    monkeypatch.setattr(
        sweep.tables, "record", lambda name, rows, run: sweep.tables.store(name, rows, run, stored)
    )
    monkeypatch.setattr(sweep.tables, "render", lambda name, *a, **k: rendered.append(name))
    search = synthetic({0: 1e-4}, {0: 2e-4})
    earlier = {**search["run"], "command": "the full search"}
    sweep.tables.store("sweep", sweep.summary_rows(search), earlier, stored)
    reruns = with_bf16(synthetic({0: 1e-4}, {0: 3e-4}), {0.01: 2.5e-4})
    path = tmp_path / "reruns.json"
    path.write_text(json.dumps(reruns))

    def table() -> dict[str, dict[str, Any]]:
        rows = json.loads((stored / "sweep.json").read_text())["rows"]
        return {row["cells"]["optimizer"]: row for row in rows}

    sweep.main(["--from-json", str(path), "--write-table", "--record", "muon-bf16m"])
    after = table()
    assert set(after) == {"adamw", "muon", "muon-bf16m"}
    assert after["adamw"]["run"] == after["muon"]["run"] == earlier
    new = {row["optimizer"]: row for row in sweep.summary_rows(reruns)}["muon-bf16m"]
    assert after["muon-bf16m"] == {"cells": new, "run": reruns["run"]}
    assert not (stored / "budget.json").exists() and rendered == []
    # An unknown name: refused by name, with the names there are; nothing recorded.
    with pytest.raises(SystemExit) as refused:
        sweep.main(["--from-json", str(path), "--write-table", "--record", "muon-bf16"])
    assert str(refused.value.code) == (
        "--record muon-bf16: this sweep has no variant of that name; give some of adamw, muon, "
        "muon-bf16m"
    )
    assert table() == after
    # Both adamw and muon recorded: the budget row too.
    sweep.main(["--from-json", str(path), "--write-table", "--record", "adamw", "muon"])
    assert table()["muon"]["run"] == reruns["run"] and rendered == ["budget"]
    assert json.loads((stored / "budget.json").read_text())["rows"][0]["cells"] == (
        sweep.budget_row(reruns)
    )
