"""benchmarks/profile_step.py end to end: two gloo ranks with torchrun's environment, forked
with torch imported (train_launch.launch_forked: a torchrun launch would import torch in its
agent and in each rank again, most of the test's time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from train_launch import launch_forked

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step


def test_a_cpu_run_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gloo ranks, a tiny training step: the report is written and says it has no
    device kernels; the table prints again from the JSON."""
    script = ROOT / "benchmarks" / "profile_step.py"
    args = ["--train", "--out", str(tmp_path), "--warmup", "1", "--steps", "1"]
    args += ["--trace-dir", str(tmp_path / "traces"), "--"]
    args += "--dim 32 --layers 2 --heads 2 --vocab 64 --seq-len 32 --batch-size 4".split()
    output = launch_forked(2, args, tmp_path / "logs", script=script)
    assert "no device kernels" in output
    report = json.loads((tmp_path / "profile_step_train.json").read_text())
    assert set(report["phases"]) == {"step", "optimizer"}
    for phase in report["phases"].values():
        assert len(phase["per_rank"]) == 2 and phase["slowest"]["wall"] > 0
    assert (
        report["phases"]["step"]["slowest"]["wall"]
        > report["phases"]["optimizer"]["slowest"]["wall"]
    )
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "summary_rank0.json",
        "summary_rank1.json",
        "trace_rank0.json",
        "trace_rank1.json",
    ]
    # The report again from its JSON: a call here, not a process importing torch again.
    monkeypatch.setattr(
        sys, "argv", [str(script), "--from-json", str(tmp_path / "profile_step_train.json")]
    )
    assert profile_step.main() == 0
    assert "| train optimizer | 2 |" in capsys.readouterr().out
