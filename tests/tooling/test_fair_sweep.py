"""scripts/fair_sweep.sh checks its arguments and paths before it makes or removes anything:
a refused call names the cause, creates no OUT folder and leaves CORPUS as it was (it once
ran ``rm -rf "$CORPUS"`` before rejecting an unknown part)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from repo_paths import ROOT

SCRIPT = ROOT / "scripts" / "fair_sweep.sh"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["confirm", "2b"], {}, "confirm '2b'"),
        (["confirm"], {}, "confirm ''"),
        (["resume"], {}, "stage 'resume'"),
        ([], {}, "stage ''"),
        (["search", "extra"], {}, "search takes no second argument"),
        (["search"], {"TOTAL_S": "-5"}, "TOTAL_S=-5"),
        (["search"], {"TOTAL_S": "soon"}, "TOTAL_S=soon"),
        (["confirm", "small"], {}, "holds no finished corpus"),
        (["search"], {}, "holds no finished corpus"),
    ],
)
def test_a_refused_call_names_its_cause_and_touches_nothing(
    tmp_path: Path, argv: list[str], env: dict[str, str], named: str
) -> None:
    corpus = tmp_path / "corpus"  # a folder without built.txt: not a corpus this script built
    corpus.mkdir()
    (corpus / "notes.txt").write_text("keep me")
    out = tmp_path / "out"
    settings = {**os.environ, "OUT": str(out), "CORPUS": str(corpus), "PYTHON": "false", **env}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *argv],
        cwd=ROOT,
        env=settings,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr, proc.stderr
    assert (corpus / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"], "a folder was made"
