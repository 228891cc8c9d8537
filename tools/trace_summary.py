"""Summarise Chrome traces from tools/profile_step.py: busy time, overlap, idle gaps.

    python tools/trace_summary.py out/trace/trace_rank1.json [more traces ...]

Per trace: GEMM, NCCL and other kernel time; how much NCCL time overlapped compute; the
gaps in which no compute kernel ran (split at 20 µs: many short gaps mean launch-bound);
the longest gaps with the kernels on either side and the innermost host (CPU) event that
spans most of the gap, which says what the host was doing meanwhile; and the kernels with
the most total time. Reads plain or gzipped JSON.
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
LONGEST_GAPS = 6


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


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def load_events(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace's GPU kernels and its host events."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    return kernels, host


def host_during(host: list[dict[str, Any]], start: float, end: float) -> str:
    """The shortest host event covering at least half of ``[start, end)``."""
    covering = [
        e
        for e in host
        if min(end, float(e["ts"]) + float(e["dur"])) - max(start, float(e["ts"]))
        >= 0.5 * (end - start)
    ]
    if not covering:
        return "no host event"
    inner = min(covering, key=lambda e: float(e["dur"]))
    return f"{inner['name'][:40]} ({float(inner['dur']) * 1e-3:.2f} ms)"


def summarise(path: Path, rows: int) -> None:
    kernels, host = load_events(path)
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
    # Which kernels bound the longest gaps says what the GPU waited for.
    starts = sorted(
        (float(e["ts"]), e["name"][:50]) for e in kernels if category(e["name"]) != "nccl"
    )
    ends = sorted(
        (float(e["ts"]) + float(e["dur"]), e["name"][:50])
        for e in kernels
        if category(e["name"]) != "nccl"
    )
    origin = compute[0][0]
    longest = sorted(zip(gaps, pairwise(compute), strict=True), reverse=True)[:LONGEST_GAPS]
    for gap, (before, after) in longest:
        last = max((item for item in ends if item[0] <= before[1]), default=(0.0, "?"))[1]
        first = min((item for item in starts if item[0] >= after[0]), default=(0.0, "?"))[1]
        print(
            f"  gap {gap * ms:6.2f} ms at +{(before[1] - origin) * ms:7.1f} ms: after {last}"
            f" | before {first} | host: {host_during(host, before[1], after[0])}"
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
