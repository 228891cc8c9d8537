"""A damaged checkpoint is never loaded (README, "Multi-node and faults"): on 2 gloo ranks, every
kind of damage (flipped bytes, truncation, deletion, garbage) to every kind of checkpoint file
(a ``.distcp`` shard, DCP's ``.metadata``, ``meta.json``) makes ``--resume`` fall back to the
previous checkpoint with one warning naming the folder, the file and the reason, and the run
ends bit for bit where the uninterrupted run ends; with no good checkpoint left every rank
stops with an error naming each file. A ``--data`` file cut under the job stops every rank
with its name and both sizes.

The cases run in one torchrun launch (checkpoint_fault_cases.py: one group, examples/train.py's
``train()`` per case, each a 2-step resume of the tiny model); one more run of the script
itself, its 2 ranks forked with torch imported (train_launch.launch_forked), shows what a
user sees: the warning on the log, the same final weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_fault_cases import CASES, NEWEST, OLDER, SHARD, STEPS, flags, flip
from repo_paths import ROOT
from train_launch import LAUNCH_TIMEOUT_S, launch_env, launch_forked

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WORKER = Path(__file__).with_name("checkpoint_fault_cases.py")
FALLBACKS = [case for case in CASES if case.expect == "fallback"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The worker's output folder and what each of its two ranks saw."""
    out = tmp_path_factory.mktemp("checkpoint_faults")
    proc = subprocess.run(
        [*TORCHRUN, str(WORKER), str(out)],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def _bitwise_equal(a: Path, b: Path) -> bool:
    ref, got = _weights(a), _weights(b)
    return ref.keys() == got.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("WARNING")]


@pytest.mark.parametrize("case", FALLBACKS, ids=[case.name for case in FALLBACKS])
def test_a_damaged_newest_checkpoint_falls_back_and_ends_as_the_uninterrupted_run(
    faults: tuple[Path, list[dict[str, Any]]], case: Any
) -> None:
    out, ranks = faults
    assert all(r["reference"]["steps"] == list(range(1, STEPS + 1)) for r in ranks)
    for rank in ranks:
        assert rank[case.name]["error"] is None
        assert rank[case.name]["steps"] == [3, 4], "not resumed from step 2"
    (warning,) = _warnings(ranks[0][case.name]["logs"])
    assert all(name in warning for name in case.named), warning
    assert f"falling back to {OLDER}" in warning
    assert _warnings(ranks[1][case.name]["logs"]) == [], "one warning, from rank 0"
    assert _bitwise_equal(out / "reference.pt", out / case.name / "final.pt")


def test_with_no_good_checkpoint_left_every_rank_stops_naming_each_file(
    faults: tuple[Path, list[dict[str, Any]]],
) -> None:
    (case,) = [c for c in CASES if c.expect == "error"]
    _, ranks = faults
    errors = [rank[case.name]["error"] for rank in ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert all(name in errors[0] for name in case.named), errors[0]
    assert "no checkpoint" in errors[0] and "can be loaded" in errors[0]


def test_a_checkpoint_without_digests_loads_with_an_info_line(
    faults: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = faults
    for rank in ranks:
        assert rank["old_format"]["error"] is None
        assert rank["old_format"]["steps"] == [], f"not resumed from {NEWEST}"
    logs = ranks[0]["old_format"]["logs"]
    assert _warnings(logs) == []
    assert any(line.startswith("INFO") and "no digests" in line for line in logs), logs


def test_a_data_file_cut_under_the_job_stops_every_rank_naming_it_and_both_sizes(
    faults: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, ranks = faults
    for rank in ranks:
        error = rank["shrinking_data"]["error"]
        assert error is not None
        assert str(out / "text.txt") in error
        assert f"{rank['shrinking_data']['size']} bytes" in error and "100 bytes" in error


def test_the_script_falls_back_with_one_warning_on_its_log(
    faults: tuple[Path, list[dict[str, Any]]],
) -> None:
    """examples/train.py --resume itself, on a flipped shard: the warning a user reads, the
    resume from step 2 and the uninterrupted run's final weights."""
    out, _ = faults
    run = out / "script"
    shutil.copytree(out / "ckpt", run / "ckpt")
    flip(run / "ckpt" / NEWEST / SHARD)
    argv = flags(run, "--ckpt-dir", str(run / "ckpt"), "--resume", "--save-final", f"{run}.pt")
    log = launch_forked(2, argv, run / "logs")
    warnings = [line for line in log.splitlines() if line.startswith("WARNING checkpoint")]
    assert len(warnings) == 1, log
    assert str(run / "ckpt" / NEWEST) in warnings[0] and SHARD in warnings[0]
    assert f"[muon] resumed {run / 'ckpt' / OLDER} " in log
    assert _bitwise_equal(out / "reference.pt", Path(f"{run}.pt"))
