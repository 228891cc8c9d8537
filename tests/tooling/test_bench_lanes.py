"""benchmarks/bench_lanes.py off a GPU: its arguments are checked by name, and a machine
without CUDA is told that captured steps need one (the timing runs on GPU machines).

``main()`` runs in the test process: a process of its own would import torch and muon_dist
(seconds on 2 cores) only to refuse its arguments or the machine."""

from __future__ import annotations

import sys

import pytest
import torch
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lanes

SCRIPT = str(ROOT / "benchmarks" / "bench_lanes.py")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lanes", "2", "0"], "--lanes [2, 0]: each lane count must be at least 1"),
        (["--repeats", "0"], "--repeats 0 must be at least 1"),
        (["--replays", "0"], "--replays 0 must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "argv", [SCRIPT, *flags])
    with pytest.raises(SystemExit) as refused:
        bench_lanes.main()
    assert refused.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_a_machine_without_cuda_is_told_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    assert bench_lanes.main() == 1
    assert "captured steps need a CUDA device" in capsys.readouterr().err
