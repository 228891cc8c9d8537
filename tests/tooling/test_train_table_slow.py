"""benchmarks/train_table.py: interleaved repeated runs of examples/train.py, and a table
whose medians and spreads are those of the runs' own metrics."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from repo_paths import ROOT
from train_launch import SCRIPT, launch_env, launch_forked

sys.path.insert(0, str(ROOT / "benchmarks"))
import train_table

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "32"]
TINY += ["--batch-size", "4", "--steps", "5"]
SKIP = 2
VARIANTS = ["adamw", "muon"]
PHASE_COLUMNS = {
    "fwd_bwd_s": "forward+backward ms",
    "opt_s": "exposed optimizer ms",
    "step_s": "step ms",
    "data_wait_s": "data wait ms",
}


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_table.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True)


def driver(*args: str) -> str:
    proc = launch(*args)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


def cells(table: str) -> dict[str, dict[str, str]]:
    """The table's rows by optimizer, each a dict by column."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]
    return {row["optimizer"]: row for row in rows}


def numbers(text: str) -> list[float]:
    """``"1,234.5 (1,000.0–2,000.0)"`` -> ``[1234.5, 1000.0, 2000.0]``."""
    return [float(n.replace(",", "")) for n in re.findall(r"[\d,]+\.?\d*", text)]


def forked_after_the_first(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make train_table's first launch as it is (torchrun) and fork the others' ranks with
    torch imported (train_launch's docstring says why: seconds a launch); the way each ran."""
    torchrun = train_table.run_logged
    ways: list[str] = []

    def run_logged(argv: Sequence[str], env: dict[str, str], log: Path) -> int:
        if not ways:
            ways.append("torchrun")
            return torchrun(argv, env, log)
        script = list(argv).index(str(SCRIPT))
        nproc = int(argv[script - 1])
        assert list(argv[:script]) == [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc),
        ]  # fmt: skip
        log.write_text(launch_forked(nproc, argv[script + 1 :], log.parent / "ranks"))
        ways.append("forked")
        return 0

    monkeypatch.setattr(train_table, "run_logged", run_logged)
    return ways


# Four launches of one rank each: the table is made of the runs' own metrics whatever the rank
# count, and each phase as the slowest of two ranks is test_train_timing.py's
# (test_step_timer_reports_each_phase_of_the_slowest_rank). The driver runs in this process
# (its own would import torch, through train.py's parser) and forks all runs but the first.
def test_interleaved_runs_and_a_table_of_their_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    ways = forked_after_the_first(monkeypatch)
    argv = [
        "--nproc", "1", "--model", "tiny", "--variants", *VARIANTS, "--repeats", "2",
        "--skip", str(SKIP), "--logs", str(logs), "--", *TINY,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "train_table.py"), *argv])
    train_table.main()
    stdout = capsys.readouterr().out
    assert ways == ["torchrun", "forked", "forked", "forked"]
    results = json.loads((logs / "results.json").read_text())
    runs = results["runs"]
    # Interleaved A B A B, each run its own launch: the order the runs' metrics were last
    # written in on disk is the order of the schedule.
    order = [(r["round"], r["variant"]) for r in runs]
    assert order == [(0, "adamw"), (0, "muon"), (1, "adamw"), (1, "muon")]
    files = [Path(r["argv"][r["argv"].index("--out") + 1]) / "metrics.jsonl" for r in runs]
    assert len(set(files)) == 4
    assert sorted(files, key=lambda f: f.stat().st_mtime_ns) == files

    per_run = []
    for run, path in zip(runs, files, strict=True):
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        assert run["metrics"] == steps, "results.json holds every raw number of the run"
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
        assert {s["optimizer"] for s in steps} == {run["variant"]}
        for s in steps:
            # The step is at least each phase and at most their sum.
            assert max(s["fwd_bwd_s"], s["opt_s"]) <= s["step_s"] + 1e-9, s
            assert s["step_s"] <= s["fwd_bwd_s"] + s["opt_s"] + 1e-9, s
        timed = steps[SKIP:]
        medians = {k: statistics.median(s[k] for s in timed) for k in PHASE_COLUMNS}
        medians["tokens_per_s"] = 4 * 32 / medians["step_s"]
        per_run.append(medians)

    table = cells((logs / "table.md").read_text())
    assert list(table) == VARIANTS
    assert (logs / "table.md").read_text() in stdout
    adamw_tps = [m["tokens_per_s"] for r, m in zip(runs, per_run, strict=True)]
    for variant in VARIANTS:
        mine = [m for r, m in zip(runs, per_run, strict=True) if r["variant"] == variant]
        summary = results["summary"][variant]
        row = table[variant]
        assert (row["model"], row["GPUs"], row["batch"]) == ("tiny", "1", "4")
        assert row["runs"] == f"2 × {5 - SKIP} steps"
        for key, column in (*PHASE_COLUMNS.items(), ("tokens_per_s", "tokens/s")):
            values = [m[key] for m in mine]
            expected = [statistics.median(values), min(values), max(values)]
            got = summary[key]
            assert [got["median"], got["min"], got["max"]] == expected, (variant, key)
            scale = 1 if key == "tokens_per_s" else 1e3
            shown = numbers(row[column])
            assert shown == pytest.approx([v * scale for v in expected], abs=0.51), column
        # Ratio of the medians; the spread pairs each run with AdamW's run of its round.
        adamw = [t for r, t in zip(runs, adamw_tps, strict=True) if r["variant"] == "adamw"]
        paired = [m["tokens_per_s"] / a for m, a in zip(mine, adamw, strict=True)]
        ratio = statistics.median(m["tokens_per_s"] for m in mine) / statistics.median(adamw)
        vs = summary["vs_baseline"]
        assert vs["median"] == pytest.approx(ratio, rel=1e-12)
        assert [vs["min"], vs["max"]] == [min(paired), max(paired)]
        shown = numbers(row["vs AdamW"])
        assert shown == pytest.approx([ratio, min(paired), max(paired)], abs=5e-4)
    assert table["adamw"]["vs AdamW"] == "1.000× (1.000–1.000×)"

    # The run is named under the table: device, versions, date and the command as typed.
    assert "benchmarks/train_table.py --nproc 1 --model tiny" in (logs / "table.md").read_text()
    assert str(logs) not in results["run"]["command"]
    # A finished comparison is reported again from its JSON alone.
    again = driver("--from-json", str(logs / "results.json"))
    assert again == (logs / "table.md").read_text()
