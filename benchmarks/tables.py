"""The current tables of benchmarks/README.md, kept in benchmarks/results/*.json.

A benchmark run with ``--write-table`` records its rows here: a row replaces the row with
the same key (say, the same preset, GPU count and backend) and the others stay, then the
table's section of the README, between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``,
is rendered again from the JSON. Every row names its run (device, torch and Triton versions,
date, command); superseded rows live in git history, not in the file.

    python benchmarks/tables.py    # render every table from the JSON files again
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
# Flags that say where output goes, not what was measured: left out of recorded commands.
OUTPUT_FLAGS = {"--write-table": 0, "--json": 1, "--write-tables": 0, "--logs": 1}
WRITE_TABLE_HELP = "record the rows in benchmarks/results/ and benchmarks/README.md"


@dataclass(frozen=True)
class Table:
    """Column headers in order; ``key`` names the columns that identify a row."""

    columns: tuple[str, ...]
    key: tuple[str, ...]


TABLES: dict[str, Table] = {
    "kernels": Table(
        (
            "shape",
            "torch ms",
            "Triton ms",
            "Gram torch ms",
            "Gram Triton ms",
            "auto ms",
            "auto runs",
            "Triton/torch",
            "error ratio",
            "1st call s",
        ),
        key=("shape",),
    ),
    "products": Table(
        (
            "stack",
            "X·Xᵀ: cuBLAS µs",
            "X·Xᵀ: Triton µs",
            "b·A + c·A·A: cuBLAS µs",
            "b·A + c·A·A: Triton µs",
        ),
        key=("stack",),
    ),
    "elementwise": Table(
        (
            "elements",
            "momentum: torch µs",
            "momentum: fused µs",
            "update + decay: torch µs",
            "update + decay: fused µs",
        ),
        key=("elements",),
    ),
    "reductions": Table(
        (
            "stack",
            "norms: torch µs",
            "norms: Triton µs",
            "sums: torch µs",
            "sums: Triton µs",
        ),
        key=("stack",),
    ),
    "step": Table(
        (
            "preset (layers)",
            "GPUs",
            "backend",
            "Newton–Schulz",
            "muon_dist ms",
            "× floor",
            "floor ms",
            "all-gather Muon",
            "fused AdamW ms",
            "peak GiB (state)",
        ),
        key=("preset (layers)", "GPUs", "backend", "Newton–Schulz"),
    ),
    "host": Table(
        ("preset (layers)", "GPUs", "backend", "eager ms", "captured ms"),
        key=("preset (layers)", "GPUs", "backend"),
    ),
    "training": Table(
        (
            "model",
            "GPUs",
            "batch",
            "optimizer",
            "forward+backward ms",
            "exposed optimizer ms",
            "step ms",
            "tokens/s",
            "data wait ms",
            "vs AdamW",
            "runs",
        ),
        key=("model", "GPUs", "batch", "optimizer"),
    ),
    "hf": Table(
        (
            "model",
            "GPUs",
            "batch × seq",
            "optimizer",
            "step ms",
            "optimizer ms",
            "tokens/s",
            "vs AdamW",
            "peak GiB",
            "last loss",
            "runs",
        ),
        key=("model", "GPUs", "batch × seq", "optimizer"),
    ),
    "sweep": Table(
        (
            "model",
            "tokens",
            "tokens/param",
            "optimizer",
            "best settings",
            "seeds",
            "final eval loss",
            "tokens to AdamW's best",
            "vs AdamW",
            "wall s to AdamW's best",
            "wall vs AdamW",
            "runs",
            "best at an edge",
        ),
        key=("model", "tokens", "optimizer"),
    ),
    "budget": Table(
        (
            "model",
            "parameters",
            "tokens",
            "tokens/param",
            "AdamW final eval loss",
            "Muon final eval loss",
            "Muon's tokens to AdamW's best",
            "Muon's wall time to AdamW's best",
            "seeds",
        ),
        key=("model", "tokens"),
    ),
    "parity": Table(
        ("GPUs", "comm / Newton–Schulz dtype", "criterion", "layouts passed", "worst (layout)"),
        key=("GPUs", "comm / Newton–Schulz dtype"),
    ),
}


def command_line(argv: Sequence[str] | None = None) -> str:
    """How this process was started, as a user would type it from the repository root."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve()
    inside = script.is_relative_to(HERE.parent)
    program = str(script.relative_to(HERE.parent)) if inside else args[0]
    kept: list[str] = []
    skip = 0
    for arg in args[1:]:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in OUTPUT_FLAGS:
            skip = 0 if "=" in arg else OUTPUT_FLAGS[name]
            continue
        kept.append(arg)
    if "LOCAL_WORLD_SIZE" in os.environ:  # launched by torchrun
        launcher = f"torchrun --standalone --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']}"
    else:
        launcher = "python3"
    return shlex.join([*launcher.split(), program, *kept])


def read_results(path: Path, tool: str, keys: Sequence[str]) -> dict[str, Any]:
    """The ``results.json`` at ``path`` that benchmarks/``tool`` wrote, or an exit naming the
    file and what is wrong with it (missing, not JSON, truncated, another tool's)."""
    what = f"a results.json written by benchmarks/{tool}"
    try:
        text = path.read_text()
    except OSError as error:
        raise SystemExit(
            f"--from-json {path}: cannot be read ({error.strerror}); give {what}"
        ) from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as error:
        raise SystemExit(
            f"--from-json {path}: not valid JSON at line {error.lineno} column {error.colno} "
            f"({error.msg}; truncated?); give {what}"
        ) from None
    missing = [k for k in keys if k not in results] if isinstance(results, dict) else list(keys)
    if missing:
        raise SystemExit(f"--from-json {path}: lacks {', '.join(missing)}; give {what}")
    return results


def run_info(gpus: int = 1, command: str | None = None) -> dict[str, str]:
    """Device, versions, date and command of the current run, for the row it writes."""
    import torch

    if torch.cuda.is_available():
        device = f"{gpus}× {torch.cuda.get_device_name()}"
    else:
        device = f"CPU ({os.cpu_count()} cores)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "device": device,
        "torch": torch.__version__.split("+")[0],
        "triton": triton_version,
        "date": datetime.now(timezone.utc).date().isoformat(),
        "command": command or command_line(),
    }


def record(
    name: str,
    rows: Sequence[Mapping[str, str]],
    run: Mapping[str, str],
    results: Path = RESULTS,
    readme: Path = README,
) -> None:
    """Put ``rows`` of one run into table ``name`` (replacing rows with their keys); render it."""
    store(name, rows, run, results)
    render(name, results, readme)


def store(
    name: str, rows: Sequence[Mapping[str, str]], run: Mapping[str, str], results: Path = RESULTS
) -> None:
    """Put ``rows`` of one run into ``results/NAME.json``, replacing the rows with their keys."""
    table = TABLES[name]
    for row in rows:
        missing = [c for c in table.key if c not in row]
        unknown = [c for c in row if c not in table.columns]
        if missing or unknown:
            raise ValueError(
                f"a row of table {name!r} lacks key columns {missing} or has unknown columns "
                f"{unknown}; its columns are {list(table.columns)}"
            )
    path = results / f"{name}.json"
    stored = json.loads(path.read_text())["rows"] if path.exists() else []
    keys = {tuple(row[c] for c in table.key) for row in rows}
    kept = [r for r in stored if tuple(r["cells"][c] for c in table.key) not in keys]
    new = [{"cells": dict(row), "run": dict(run)} for row in rows]
    results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": kept + new}, indent=1, ensure_ascii=False) + "\n")


def markdown(name: str, results: Path = RESULTS) -> str:
    """Table ``name`` as markdown: one row per stored row, then the runs they came from."""
    table = TABLES[name]
    path = results / f"{name}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    if not rows:
        return "No measurement recorded yet.\n"
    runs: list[dict[str, str]] = []
    lines = [
        "| " + " | ".join((*table.columns, "run")) + " |",
        "|" + " --- |" * (len(table.columns) + 1),
    ]
    for row in rows:
        if row["run"] not in runs:
            runs.append(row["run"])
        cells = [row["cells"].get(c, "—") for c in table.columns]
        lines.append("| " + " | ".join([*cells, f"[{runs.index(row['run']) + 1}]"]) + " |")
    lines.append("")
    for index, run in enumerate(runs, 1):
        lines.append(
            f"- [{index}] {run['device']}, torch {run['torch']}, Triton {run['triton']}, "
            f"{run['date']}: `{run['command']}`"
        )
    return "\n".join(lines) + "\n"


def render(name: str, results: Path = RESULTS, readme: Path = README) -> None:
    """Replace the README section between table ``name``'s markers with the stored table."""
    begin, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    text = readme.read_text()
    if text.count(begin) != 1 or text.count(end) != 1:
        raise RuntimeError(
            f"{readme} needs exactly one '{begin}' and one '{end}' line around table {name!r}"
        )
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    readme.write_text(f"{head}{begin}\n{markdown(name, results)}{end}{tail}")


def main() -> None:
    for name in TABLES:
        render(name)


if __name__ == "__main__":
    main()
