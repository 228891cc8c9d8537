"""scripts/gpu_tests.sh on a machine without CUDA: it says so, exits 1 and creates nothing
(the suite it runs, tests/gpu, needs a GPU; CI has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_tests.sh"


def test_without_cuda_it_refuses_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu_out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "no CUDA device here" in done.stderr
    assert not out.exists()
