"""Rank-side cases of test_train_timing.py: examples/train.py's step timer on a group."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from repo_paths import ROOT

if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))  # train.py imports its neighbours data and model

import train


def slowest_rank_worker(rank: int, world_size: int, sleeps: dict[str, list[float]]) -> Any:
    """One timed step in which each rank sleeps ``sleeps[phase][rank]`` seconds per phase:
    ``late`` before the barrier, ``fwd_bwd`` before backward ends, ``opt`` after."""
    timer = train.StepTimer(torch.device("cpu"))
    time.sleep(sleeps["late"][rank])
    timer.start()
    time.sleep(sleeps["fwd_bwd"][rank])
    timer.backward_done()
    time.sleep(sleeps["opt"][rank])
    timer.stop()
    return timer.slowest(data_wait=sleeps["data_wait"][rank])
