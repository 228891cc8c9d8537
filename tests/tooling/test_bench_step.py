"""benchmarks/bench_step.py --from-json: a finished run's JSON printed and recorded again on
another machine, under the run info the JSON keeps (device, versions, command), with no
process group and no timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_step

RUN = {
    "device": "4× NVIDIA H200",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "date": "2026-11-28",
    "command": "torchrun --standalone --nproc-per-node 4 benchmarks/bench_step.py --preset tiny",
}


def _method(name: str, median_ms: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "times_ms": [median_ms] * 5,
        "median_ms": median_ms,
        "peak_gib_per_rank": [1.5, 1.25, None, 1.5],
        "sent_mib_per_rank": [2.0, 2.0, 2.0, 2.0],
        "floor_multiple": median_ms / 4.0,
        "speedup_vs_allgather": 40.0 / median_ms,
        **extra,
    }


def _report(captured: bool) -> dict[str, Any]:
    """A report as a 4-GPU run writes it: muon_dist per Newton–Schulz method, optionally
    its captured step, then the all-gather baseline and AdamW (always last)."""
    methods = [
        _method("muon_dist auto inflight=3", 10.0, ns_method="auto", rule="muon"),
        _method("muon_dist standard inflight=3", 12.0, ns_method="standard", rule="muon"),
    ]
    if captured:
        methods.append(_method("muon_dist graph auto inflight=3", 2.0, ns_method="auto"))
    methods += [_method("allgather_muon", 40.0), _method("adamw fused", 5.0)]
    options = {"backend": "auto", "ns_methods": ["auto", "standard"], "bucket_mb": 128.0}
    return {
        "preset": "tiny",
        "layers": 2,
        "params": 2_124_288,
        "muon_matrices": 44,
        "world_size": 4,
        "mesh_shape": [4],
        "mesh_names": ["shard"],
        "device": "NVIDIA H200",
        "options": options,
        "matmul_size": 8192,
        "matmul_tflops": 700.0,
        "ns_flops": 1.0e10,
        "floor_ms": 4.0,
        "state_gib_per_rank": [0.02] * 4,
        "parity": {"update_rel": 1e-3, "shard_rel": 1e-4, "tolerance": 2e-2, "ok": True},
        "methods": methods,
        "run": RUN,
        **({"timing_ms": 0.04} if captured else {}),
    }


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> list[tuple[str, Any, Any]]:
    """Run bench_step.main with ``args``; the tables it would record."""
    recorded: list[tuple[str, Any, Any]] = []
    monkeypatch.setattr(
        bench_step.tables, "record", lambda name, rows, run: recorded.append((name, rows, run))
    )
    monkeypatch.setattr(sys, "argv", ["bench_step.py", *args])
    assert bench_step.main() == 0
    return recorded


@pytest.mark.parametrize("captured", [True, False])
def test_from_json_records_the_rows_under_the_run_it_keeps(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    captured: bool,
) -> None:
    path = tmp_path / "bench_step_tiny.json"
    report = _report(captured)
    path.write_text(json.dumps(report))
    recorded = _main(monkeypatch, "--from-json", str(path), "--write-table")
    out = capsys.readouterr().out
    assert "muon_dist auto inflight=3" in out
    # What the timing adds, where the run measured it (reports before it did not).
    assert ("around an empty step: 0.040 ms" in out) == ("timing_ms" in report)
    expected = [("step", bench_step.table_rows(report), RUN)]
    if captured:
        expected.append(("host", [bench_step.host_row(report, report["methods"][2])], RUN))
    assert recorded == expected
    if captured:  # the eager step is muon_dist's first timing, against the captured one
        assert recorded[1][1][0]["eager ms"] == "10.00"
        assert recorded[1][1][0]["captured ms"] == "2.00"
    assert _main(monkeypatch, "--from-json", str(path)) == []  # printed, nothing recorded


def test_from_json_refuses_a_file_without_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.json"
    report = _report(True)
    del report["run"]
    path.write_text(json.dumps(report))
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--from-json", str(path), "--write-table"])
    with pytest.raises(SystemExit, match=r"old\.json: lacks run; give a results\.json"):
        bench_step.main()
