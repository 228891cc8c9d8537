"""tools/step_snapshot.py refuses what it cannot use, naming it, before it records or compares:
no arguments, a snapshot path that exists (never replaced), and files that are no snapshot;
its comparison holds dtypes as well as bits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import step_snapshot


def _snapshot(path: Path, value: torch.Tensor | None = None) -> Path:
    rank = {"tensors": {"g0.p0": torch.ones(2) if value is None else value}, "raised": []}
    torch.save({"w1.fsdp": [{**rank, "ops": {}}]}, path)
    return path


def test_no_command_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        step_snapshot.main([])
    assert refused.value.code == 2 and "record|compare" in capsys.readouterr().err


def test_record_never_replaces_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_snapshot, "record", lambda path: pytest.fail("recorded"))
    earlier = _snapshot(tmp_path / "before.pt")
    kept = earlier.read_bytes()
    for path, named in ((earlier, "already exists"), (tmp_path / "no" / "x.pt", "not a folder")):
        with pytest.raises(SystemExit) as refused:
            step_snapshot.main(["record", str(path)])
        assert refused.value.code == 2 and named in capsys.readouterr().err
    assert earlier.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before.pt"]


def test_compare_names_a_file_that_is_no_snapshot(tmp_path: Path) -> None:
    good = _snapshot(tmp_path / "good.pt")
    text = tmp_path / "notes.txt"
    text.write_text("not a snapshot")
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor)
    cases = [
        (text, "is not a torch.save file"),
        (tensor, "holds no snapshot"),
        (tmp_path / "missing.pt", "cannot be read"),
    ]
    for path, problem in cases:
        with pytest.raises(SystemExit) as refused:
            step_snapshot.main(["compare", str(good), str(path)])
        message = str(refused.value.code)
        assert message.startswith(f"compare: {path} ") and problem in message, message
    assert step_snapshot.main(["compare", str(good), str(good)]) == 0


def test_compare_counts_a_changed_dtype_with_equal_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state tensor stored in another dtype (a momentum in bf16) is a mismatch even where
    its values are equal, which torch.equal alone would accept."""
    fp32 = _snapshot(tmp_path / "fp32.pt")
    bf16 = _snapshot(tmp_path / "bf16.pt", torch.ones(2, dtype=torch.bfloat16))
    assert step_snapshot.main(["compare", str(fp32), str(bf16)]) == 1
    out = capsys.readouterr().out
    assert "g0.p0: dtype torch.float32 -> torch.bfloat16" in out and "1 mismatches" in out
