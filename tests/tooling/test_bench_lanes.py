"""benchmarks/bench_lanes.py off a GPU: its arguments are checked by name, and a machine
without CUDA is told that captured steps need one (the timing runs on GPU machines)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from repo_paths import ROOT

SCRIPT = str(ROOT / "benchmarks" / "bench_lanes.py")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lanes", "2", "0"], "--lanes [2, 0]: each lane count must be at least 1"),
        (["--repeats", "0"], "--repeats 0 must be at least 1"),
        (["--replays", "0"], "--replays 0 must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_a_machine_without_cuda_is_told_so() -> None:
    done = subprocess.run(
        [sys.executable, SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "captured steps need a CUDA device" in done.stderr
