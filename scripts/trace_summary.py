"""Summarise Chrome traces from scripts/profile_step.py: busy time, overlap, idle gaps.

    python scripts/trace_summary.py out/trace/trace_rank1.json [more traces ...]

Per trace: GEMM, NCCL and other kernel time; how much NCCL time overlapped compute; the
gaps in which no compute kernel ran (split at 20 µs: many short gaps mean launch-bound);
and the kernels with the most total time. Reads plain or gzipped JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "_sym_product_kernel")
SHORT_GAP_US = 20.0


def category(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "nccl"
    if any(marker in lowered for marker in GEMM_MARKERS):
        return "gemm"
    if "memcpy" in lowered or "memset" in lowered:
        return "memcpy"
    return "other"


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        length += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


def load_kernels(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def summarise(path: Path, rows: int) -> None:
    kernels = load_kernels(path)
    if not kernels:
        print(f"{path}: no GPU kernels (a CPU trace?)")
        return
    spans: dict[str, list[Interval]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        kind = category(e["name"])
        spans[kind].append(span)
        by_name[e["name"][:100]].append(float(e["dur"]))
    window = max(end for s in spans.values() for _, end in s) - min(
        start for s in spans.values() for start, _ in s
    )
    comm = union(spans["nccl"])
    compute = union([s for kind, s_list in spans.items() if kind != "nccl" for s in s_list])
    gaps = [b[0] - a[1] for a, b in pairwise(compute)]
    ms = 1e-3
    print(f"== {path}: window {window * ms:.1f} ms, {len(kernels)} kernels")
    print(
        f"  compute busy {total(compute) * ms:.1f} ms (GEMM {total(union(spans['gemm'])) * ms:.1f},"
        f" memcpy {total(union(spans['memcpy'])) * ms:.1f}); NCCL busy {total(comm) * ms:.1f} ms,"
        f" {overlap(comm, compute) * ms:.1f} ms of it overlapping compute"
    )
    short = sum(g for g in gaps if g < SHORT_GAP_US)
    print(
        f"  no compute kernel running for {sum(gaps) * ms:.1f} ms: {short * ms:.1f} ms in gaps"
        f" under {SHORT_GAP_US:.0f} µs, {(sum(gaps) - short) * ms:.1f} ms in longer ones"
    )
    for name, durations in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"  {sum(durations) * ms:8.2f} ms {len(durations):6d}x  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=15, help="kernels to list per trace")
    args = parser.parse_args()
    for path in args.traces:
        summarise(path, args.rows)


if __name__ == "__main__":
    main()
