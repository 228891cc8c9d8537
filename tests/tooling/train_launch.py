"""Launching examples/train.py for the tooling tests: under torchrun on CPU/gloo with a tiny
model (``TINY``), or as one plain process, and reading what a run wrote.

``TINY`` runs fp32 communication and fp32 Newton-Schulz, so that runs on different world
sizes differ by fp32 rounding only (test_train_resume_slow.py's docstring says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from repo_paths import ROOT

SCRIPT = ROOT / "examples" / "train.py"
TINY = [
    "--dim", "32",
    "--layers", "2",
    "--heads", "2",
    "--vocab", "64",
    "--seq-len", "32",
    "--batch-size", "6",  # divides 1, 2 and 3 ranks alike; uneven splits work too
    "--steps", "10",
    "--comm-dtype", "fp32",
    "--ns-dtype", "fp32",
    "--no-progress",
    "--no-plot",  # drawing takes seconds a launch: drawn() where a test reads the plot
]  # fmt: skip
LAUNCH_TIMEOUT_S = 300


def launch_env() -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("WORLD_SIZE", None)  # a plain run must take the one-process path
    return env


def drawn(args: Sequence[str]) -> list[str]:
    """``args`` with loss.png drawn."""
    return [a for a in args if a != "--no-plot"]


def launch(nproc: int | None, args: Sequence[str]) -> str:
    """Run train.py on ``nproc`` ranks via torchrun, or as a plain process when None."""
    env = launch_env()
    if nproc is None:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc), str(SCRIPT), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def losses(out: Path, optimizer: str = "muon") -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["optimizer"] == optimizer}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in keys)
