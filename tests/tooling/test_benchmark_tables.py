"""benchmarks/tables.py: rows replace rows with the same key, sections render between markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import ROOT, benchmark_tables

tables = benchmark_tables()
RUN = {"device": "1× GPU", "torch": "2.11", "triton": "3.6", "date": "2026-11-23", "command": "x"}


def _readme(tmp_path: Path) -> Path:
    readme = tmp_path / "README.md"
    readme.write_text("# B\n\nintro\n\n<!-- table:step -->\nold\n<!-- /table:step -->\n\nafter\n")
    return readme


def _row(preset: str, backend: str, ms: str) -> dict[str, str]:
    return {
        "preset (layers)": preset,
        "GPUs": "2",
        "backend": backend,
        "Newton–Schulz": "auto",
        "muon_dist ms": ms,
    }


def test_record_replaces_rows_with_the_same_key_and_keeps_the_rest(tmp_path: Path) -> None:
    readme = _readme(tmp_path)
    results = tmp_path / "results"
    tables.record(
        "step",
        [_row("a (1)", "torch", "10.0"), _row("b (1)", "torch", "20.0")],
        RUN,
        results,
        readme,
    )
    later = {**RUN, "date": "2026-11-24", "command": "y"}
    tables.record("step", [_row("a (1)", "torch", "9.0")], later, results, readme)
    stored = json.loads((results / "step.json").read_text())["rows"]
    assert [(r["cells"]["preset (layers)"], r["cells"]["muon_dist ms"]) for r in stored] == [
        ("b (1)", "20.0"),
        ("a (1)", "9.0"),
    ]
    text = readme.read_text()
    assert text.startswith("# B\n\nintro\n\n<!-- table:step -->\n| preset (layers) |")
    assert text.endswith("<!-- /table:step -->\n\nafter\n") and "old" not in text
    # Every row names its run; each run is listed once with device, versions, date, command.
    assert "| b (1) | 2 | torch | auto | 20.0 | — |" in text and "| [1] |" in text
    assert "- [1] 1× GPU, torch 2.11, Triton 3.6, 2026-11-23: `x`" in text
    assert "- [2] 1× GPU, torch 2.11, Triton 3.6, 2026-11-24: `y`" in text


def test_bad_rows_and_missing_markers_raise(tmp_path: Path) -> None:
    readme = _readme(tmp_path)
    with pytest.raises(ValueError, match=r"lacks key columns \['backend', 'Newton–Schulz'\]"):
        tables.record("step", [{"preset (layers)": "a", "GPUs": "1"}], RUN, tmp_path, readme)
    with pytest.raises(ValueError, match=r"unknown columns \['speed'\]"):
        tables.record("step", [{**_row("a", "torch", "1"), "speed": "2"}], RUN, tmp_path, readme)
    with pytest.raises(RuntimeError, match=r"<!-- table:kernels -->"):
        tables.render("kernels", tmp_path, readme)


def test_command_line_drops_output_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = [
        str(ROOT / "benchmarks" / "bench_kernels.py"),
        "--json",
        "o.json",
        "--write-table",
        "--cold-cache",
    ]
    assert tables.command_line(argv) == "python3 benchmarks/bench_kernels.py --cold-cache"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    argv = [str(ROOT / "benchmarks" / "bench_step.py"), "--preset", "llama8b", "--json=x"]
    expected = "torchrun --standalone --nproc-per-node 4 benchmarks/bench_step.py --preset llama8b"
    assert tables.command_line(argv) == expected


def test_readme_sections_match_the_stored_results() -> None:
    """benchmarks/README.md is what tables.py renders from benchmarks/results/."""
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for name in tables.TABLES:
        section = readme.split(f"<!-- table:{name} -->\n")[1].split(f"<!-- /table:{name} -->")[0]
        assert section == tables.markdown(name), f"run `python benchmarks/tables.py` ({name})"
