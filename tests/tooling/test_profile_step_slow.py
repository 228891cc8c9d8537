"""benchmarks/profile_step.py end to end: two gloo ranks through torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step


def test_a_cpu_run_end_to_end(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gloo ranks, a tiny training step: the report is written and says it has no
    device kernels; the table prints again from the JSON."""
    script = str(ROOT / "benchmarks" / "profile_step.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [script, "--train", "--out", str(tmp_path), "--warmup", "1", "--steps", "1"]
    cmd += ["--trace-dir", str(tmp_path / "traces"), "--"]
    cmd += "--dim 32 --layers 2 --heads 2 --vocab 64 --seq-len 32 --batch-size 4".split()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no device kernels" in run.stdout
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
        sys, "argv", [script, "--from-json", str(tmp_path / "profile_step_train.json")]
    )
    assert profile_step.main() == 0
    assert "| train optimizer | 2 |" in capsys.readouterr().out
