"""benchmarks/train_table.py refuses bad input before it spends time: arguments that give no
table fail before the first launch, and ``--from-json`` names the file and what is wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from test_train_table_slow import TINY, launch

sys.path.insert(0, str(ROOT / "benchmarks"))
import train_table


@pytest.mark.parametrize(
    ("own", "training", "named"),
    [
        (["--skip", "10"], ["--steps", "4"], ["--skip 10", "--steps 4"]),
        (["--nproc", "2"], ["--batch-size", "1"], ["--batch-size 1", "--nproc 2"]),
        (["--repeats", "0"], [], ["--repeats 0"]),
        (["--nproc", "-1"], [], ["--nproc -1"]),
        ([], ["--data", "missing_*.bin"], ["--data 'missing_*.bin' matches no file"]),
    ],
)
def test_arguments_that_give_no_table_fail_before_the_first_launch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    own: list[str],
    training: list[str],
    named: list[str],
) -> None:
    # train_table.main() called here: a process of its own would import torch (through
    # train.py's parser) only to refuse the arguments.
    logs = tmp_path / "logs"
    argv = ["--model", "tiny", "--logs", str(logs), *own, "--", *TINY[:-2], *training]
    monkeypatch.setattr(sys, "argv", ["train_table.py", *argv])
    with pytest.raises(SystemExit) as refused:
        train_table.main()
    # A SystemExit's message, or argparse's on stderr: what the command line would print.
    message = f"{refused.value.code}\n{capsys.readouterr().err}"
    assert refused.value.code not in (0, None), message
    for flag in named:
        assert flag in message, message
    assert not logs.exists(), "a refused comparison left its --logs folder"


def test_a_used_logs_folder_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "results.json").write_text("{}")
    monkeypatch.setattr(train_table, "launch", lambda *a: pytest.fail("a run was launched"))
    argv = ["--model", "tiny", "--logs", str(logs), "--skip", "1", "--", *TINY]
    monkeypatch.setattr(sys, "argv", ["train_table.py", *argv])
    with pytest.raises(SystemExit, match=f"--logs {logs} already exists"):
        train_table.main()
    assert (logs / "results.json").read_text() == "{}"


def test_from_json_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"model": "tiny", "runs": [')
    sweep_json = tmp_path / "sweep.json"
    sweep_json.write_text(
        json.dumps({"model": "tiny", "flags": [], "tokens_per_run": 1, "runs": []})
    )
    cases = [
        (truncated, "not valid JSON"),
        (sweep_json, "lacks nproc"),
        (tmp_path / "missing.json", "cannot be read"),
    ]
    for path, problem in cases:
        proc = launch("--from-json", str(path))
        assert proc.returncode != 0
        assert f"--from-json {path}: " in proc.stderr and problem in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
