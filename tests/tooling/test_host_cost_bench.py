"""benchmarks/host_cost.py on CPU: one process, bench_hf's Qwen3 dense at a 64th of its
widths, every figure reported per step, per matrix and per bucket."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from repo_paths import ROOT

pytest.importorskip("transformers")


def test_a_run_reports_operations_calls_and_host_time() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "host_cost.py"), "--scale", "64"]
    argv += ["--warmup", "1", "--steps", "2", "--sites", "3", "--functions", "3"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # 16 layers of q, k, v, o, gate, up and down: the full model's matrices.
    assert lines[0].startswith("qwen3-dense / 64 on 1 ranks: 112 Muon matrices, ")
    assert lines[1].startswith("ops/step ") and "per matrix" in lines[1]
    assert lines[2].startswith("python calls/step ")
    assert lines[3].startswith("host ms/step ") and "(slowest rank, 2 steps)" in lines[3]
    assert lines[4] == "ops by muon_dist function:" and "function calls" in done.stdout


def test_counts_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: a process of its own would import torch only to refuse the count.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_cost

    with pytest.raises(SystemExit) as refused:
        host_cost.main(["--steps", "0"])
    assert refused.value.code == 2 and "--steps 0 must be >= 1" in capsys.readouterr().err
