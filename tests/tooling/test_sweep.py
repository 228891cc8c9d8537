"""benchmarks/sweep.py: the line search brackets each optimizer's best, and the scores are
read from the runs' eval curves; plus one tiny sweep of real runs on the CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from test_train_example_slow import launch_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import sweep
from sweep import Config, Grid, Planner

# Where each synthetic bowl has its minimum (log-scale distance from it is the score).
OPTIMA = {
    ("adamw", "adamw_lr"): 3e-4,  # below every starting point: its line must grow down
    ("muon", "spectral_norm"): 0.03,
    ("muon", "rms_norm"): 2e-3,
}
EMBED_OPTIMUM = 1.6e-2  # above every starting point


def bowl(config: Config) -> float:
    """A convex score in every log-lr, lowest for Muon with spectral_norm."""
    if config.optimizer == "adamw":
        assert config.adamw_lr is not None
        return 3.0 + math.log(config.adamw_lr / OPTIMA["adamw", "adamw_lr"]) ** 2
    assert config.lr is not None and config.muon_adamw_lr is not None
    assert config.adjust_lr is not None
    offset = {"muon": 2.0, "normuon": 1.9, "dion2": 2.1}[config.optimizer]
    offset += 0.0 if config.adjust_lr == "spectral_norm" else 0.5
    lr = math.log(config.lr / OPTIMA["muon", config.adjust_lr]) ** 2
    return offset + lr + 0.3 * math.log(config.muon_adamw_lr / EMBED_OPTIMUM) ** 2


def run_planner(grid: Grid, parallel: int) -> dict[Config, float]:
    """Drive the planner as the sweep does, ``parallel`` runs at a time."""
    planner = Planner(grid)
    scores: dict[Config, float] = {}
    started: set[Config] = set()
    for _ in range(200):
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
def test_the_search_brackets_every_best(parallel: int) -> None:
    grid = Grid(
        adamw_lrs=[1e-3, 2e-3, 4e-3],
        muon_lrs={"spectral_norm": [0.01, 0.02, 0.04], "rms_norm": [1e-3, 2e-3, 4e-3]},
        muon_adamw_lrs=[4e-3, 2e-3, 8e-3],
        grow=3,
    )
    scores = run_planner(grid, parallel)
    by = {name: [c for c in scores if c.optimizer == name] for name in ("adamw", "muon")}
    adamw = min(by["adamw"], key=scores.__getitem__)
    muon = min(by["muon"], key=scores.__getitem__)
    assert bracketed(scores, adamw, "adamw_lr")
    assert adamw.adamw_lr == pytest.approx(2.5e-4, rel=0.3)
    assert muon.adjust_lr == "spectral_norm"
    assert bracketed(scores, muon, "lr") and bracketed(scores, muon, "muon_adamw_lr")
    assert muon.muon_adamw_lr == 1.6e-2
    # NorMuon and Dion2 ran once each, at Muon's best settings.
    for name in sweep.ALSO_AT_BEST:
        assert [c for c in scores if c.optimizer == name] == [
            Config(name, muon.lr, muon.adjust_lr, muon.muon_adamw_lr)
        ]


def test_a_line_stops_growing_at_its_limit() -> None:
    grid = Grid(
        adamw_lrs=[1e-2, 2e-2, 4e-2],
        muon_lrs={"spectral_norm": [0.01, 0.02, 0.04]},
        muon_adamw_lrs=[4e-3, 8e-3, 2e-3],
        grow=1,
    )
    scores = run_planner(grid, 4)
    assert sorted(c.adamw_lr for c in scores if c.optimizer == "adamw") == [5e-3, 1e-2, 2e-2, 4e-2]
    results = {"runs": [{"config": c.__dict__, "score": s} for c, s in scores.items()]}
    best = sweep.best_runs(results["runs"])["adamw"]
    assert sweep.unbracketed(best, results["runs"]) == ["adamw-lr"]


def test_tokens_to_reach_interpolates_between_evals() -> None:
    curve = [(100, 5.0), (200, 4.0), (300, 3.0)]
    assert sweep.tokens_to_reach(curve, 3.5) == pytest.approx(250.0)
    assert sweep.tokens_to_reach(curve, 5.5) == 100.0
    assert sweep.tokens_to_reach(curve, 2.9) is None
    assert sweep.final_score(curve, 0) == 3.0
    assert math.isinf(sweep.final_score(curve, 1))
    assert math.isinf(sweep.final_score([(100, math.nan)], 0))


TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"]
TINY += ["--batch-size", "4", "--steps", "6", "--eval-every", "3", "--eval-batches", "1"]


def test_a_fixed_sweep_trains_and_scores_real_runs(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    logs = tmp_path / "logs"
    argv = [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--logs", str(logs)]
    argv += ["--model", "tiny", "--runs", "adamw --adamw-lr 3e-3", "muon --lr 0.02"]
    argv += ["--", "--data", str(text), *TINY]
    done = subprocess.run(argv, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((logs / "results.json").read_text())
    assert sorted(r["config"]["optimizer"] for r in results["runs"]) == ["adamw", "muon"]
    for run in results["runs"]:
        assert run["exit_code"] == 0
        assert [tokens for tokens, _ in run["curve"]] == [3 * 4 * 32, 6 * 4 * 32]
        assert run["score"] == run["curve"][-1][1]
    rows = sweep.summary_rows(results)
    assert {row["optimizer"] for row in rows} == {"adamw", "muon"}
    assert "| adamw |" in (logs / "table.md").read_text()
