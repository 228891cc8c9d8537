"""Record every parameter and state tensor after a few steps of the distributed parity cases,
to compare two versions of the step bitwise (a refactor must not change one bit).

    PYTHONPATH=$PWD python tools/step_snapshot.py record /tmp/before.pt
    PYTHONPATH=$PWD python tools/step_snapshot.py compare /tmp/before.pt /tmp/after.pt

Runs the layout cases of ``tests/distributed/parity/parity_cases.py`` under every update
rule (Muon, NorMuon, Dion2) and the feature cases of
``tests/distributed/features/feature_cases.py`` (views, Magma, cautious decay, QK-clip) with
fp32 Newton–Schulz and fp32 communication on 1 to 4 gloo ranks, plus skipped and raised
non-finite steps, and keeps
each rank's local tensors (parameters, momenta, Magma scores, AdamW moments) and, for the
layout cases, how many operations of each kind the last step dispatched (views included).
Two records match where every tensor has the same dtype and the same bits.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from dispatch_count import CountOps
from dist_harness import close_pools, run_distributed
from repo_paths import add_module_folders_to_path

add_module_folders_to_path()  # before a pool starts: its ranks import the workers by name

WORLD_SIZES = (1, 2, 3, 4)
RULES = ("muon", "normuon", "dion2")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            out[f"g{g}.p{i}"] = _local(p)
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor):
                    out[f"g{g}.p{i}.{key}"] = _local(value)
    return out


def parity_snapshot(
    rank: int, world_size: int, name: str, bad_step: int, rule: str = "muon"
) -> dict[str, Any]:
    """Three steps of parity case ``name`` (fp32) under update ``rule``; ``bad_step`` >= 0
    puts a NaN into the first parameter's gradient at that step."""
    import parity_cases as pc

    import muon_dist

    base = name.removesuffix("+nan").split("@")[0]
    (case,) = [c for c in pc.cases_for(world_size) if c.name == base]
    gen = torch.Generator().manual_seed(1234)
    fulls = [torch.randn(s.shape, generator=gen).to(s.dtype) for s in case.params]
    grads = [
        [torch.randn(s.shape, generator=gen).to(s.dtype) for s in case.params]
        for _ in range(pc.STEPS)
    ]
    if bad_step >= 0:
        grads[bad_step][0].view(-1)[0] = float("nan")
    params, _ = pc._shard(case, fulls, world_size, "cpu")
    opt = muon_dist.Muon(
        pc._groups(case, params),
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        replica_mode=case.replica_mode,
        rule=rule,
        **case.extra,
    )
    raised: list[str] = []
    counter = CountOps()
    for step, step_grads in enumerate(grads):
        pc.set_grads(params, step_grads)
        try:
            if step == len(grads) - 1:
                with counter:
                    opt.step()
            else:
                opt.step()
        except FloatingPointError as exc:
            raised.append(type(exc).__name__)
    try:
        opt.check_finite()
    except FloatingPointError as exc:
        raised.append(type(exc).__name__)
    return {"tensors": _snapshot(opt), "raised": raised, "ops": dict(counter.ops)}


def feature_snapshot(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Three steps of feature case ``name`` with fp32 Newton–Schulz and communication."""
    import feature_cases as fc
    from parity_cases import set_grads

    import muon_dist

    make, layout, clip = fc.LAYOUT_CASES[name]
    specs = make()
    gen = torch.Generator().manual_seed(99)
    fulls = [torch.randn(s.shape, generator=gen) for s in specs]
    base = [torch.randn(s.shape, generator=gen) for s in specs]
    grads = [
        [b * (-1) ** (t + i) + torch.randn(b.shape, generator=gen) for i, b in enumerate(base)]
        for t in range(fc.STEPS)
    ]
    params = fc._distribute(layout, fulls, world_size)
    groups = [
        {"params": [p], "param_names": [s.name], "algorithm": "muon", **fc.BASE, **s.options}
        for p, s in zip(params, specs, strict=True)
    ]
    tracker = muon_dist.MaxLogitTracker()
    opt = muon_dist.Muon(
        groups,
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
        qk_clip=fc.CLIPS if clip else (),
        max_logits=tracker if clip else None,
    )
    for step, step_grads in enumerate(grads):
        set_grads(params, step_grads)
        if clip:
            for i, c in enumerate(fc.CLIPS):
                tracker.record(c.layer, fc._logits(step, i, rank, c.num_heads))
        opt.step()
    return {"tensors": _snapshot(opt), "raised": []}


def _cases(world_size: int) -> list[tuple[str, Any, tuple[Any, ...]]]:
    import feature_cases as fc
    import parity_cases as pc

    cases: list[tuple[str, Any, tuple[Any, ...]]] = [
        (name, parity_snapshot, (name, -1)) for name in pc.case_names(world_size)
    ]
    cases += [
        (f"{name}@{rule}", parity_snapshot, (name, -1, rule))
        for name in pc.case_names(world_size)
        for rule in RULES[1:]
    ]
    cases += [
        ("fsdp_skip_mode+nan", parity_snapshot, ("fsdp_skip_mode+nan", 1)),
        ("fsdp+nan", parity_snapshot, ("fsdp+nan", 1)),
    ]
    layouts = {"fsdp": True, "replicated": True, "hsdp": world_size % 2 == 0}
    cases += [
        (name, feature_snapshot, (name,))
        for name, (_, layout, _) in fc.LAYOUT_CASES.items()
        if layouts[layout]
    ]
    return cases


def record(path: Path) -> None:
    """Run every case and save the snapshot, written beside ``path`` and renamed to it once
    whole (a recording cut off leaves no file under its name)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for world_size in WORLD_SIZES:
        for name, fn, args in _cases(world_size):
            results[f"w{world_size}.{name}"] = run_distributed(world_size, fn, *args)
            print(f"w{world_size}.{name}", flush=True)
    close_pools()
    partial = path.with_name(f".{path.name}.partial")
    torch.save(results, partial)
    os.replace(partial, path)


def load(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The snapshot at ``path``, or an exit naming the file and what is wrong with it."""
    what = "give a file written by `tools/step_snapshot.py record`"
    try:
        data = torch.load(path, weights_only=True)
    except OSError as error:
        raise SystemExit(f"compare: {path} cannot be read ({error.strerror}); {what}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"compare: {path} is not a torch.save file ({first}); {what}") from None
    ranks = data.values() if isinstance(data, dict) else [None]
    if not all(isinstance(r, list) and all(_is_rank(x) for x in r) for r in ranks):
        raise SystemExit(f"compare: {path} holds no snapshot (cases of per-rank tensors); {what}")
    return data


def _is_rank(entry: Any) -> bool:
    return isinstance(entry, dict) and {"tensors", "raised"} <= entry.keys()


def compare(before_path: Path, after_path: Path) -> int:
    before = load(before_path)
    after = load(after_path)
    if set(before) != set(after):
        print(f"different cases: {sorted(set(before) ^ set(after))}")
        return 1
    tensors = mismatches = 0
    op_changes: Counter[tuple[tuple[str, int], ...]] = Counter()
    for case in sorted(before):
        for rank, (a, b) in enumerate(zip(before[case], after[case], strict=True)):
            ops_a, ops_b = Counter(a.get("ops", {})), Counter(b.get("ops", {}))
            if ops_a != ops_b:
                delta = {k: ops_b[k] - ops_a[k] for k in ops_a | ops_b if ops_a[k] != ops_b[k]}
                op_changes[tuple(sorted(delta.items()))] += 1
            if a["raised"] != b["raised"]:
                print(f"{case} rank {rank}: raised {a['raised']} -> {b['raised']}")
                mismatches += 1
            if set(a["tensors"]) != set(b["tensors"]):
                print(f"{case} rank {rank}: different tensors")
                mismatches += 1
                continue
            for key, t in a["tensors"].items():
                tensors += 1
                other = b["tensors"][key]
                if t.dtype != other.dtype:  # torch.equal compares values only
                    print(f"{case} rank {rank} {key}: dtype {t.dtype} -> {other.dtype}")
                    mismatches += 1
                elif not torch.equal(t, other):
                    print(f"{case} rank {rank} {key}: differs")
                    mismatches += 1
    for delta, count in op_changes.items():
        print(f"operations of the last step changed on {count} case-ranks: {dict(delta)}")
    print(f"{len(before)} cases, {tensors} tensors compared, {mismatches} mismatches")
    return 1 if mismatches else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = p.add_subparsers(dest="command", required=True, metavar="record|compare")
    recording = commands.add_parser("record", help="run the cases and save their tensors")
    recording.add_argument("path", type=Path, help="the snapshot to write (a new file)")
    comparing = commands.add_parser("compare", help="compare two snapshots bit for bit")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.command == "record":
        if args.path.exists():
            p.error(f"record: {args.path} already exists; name a new file (it is never replaced)")
        if not args.path.parent.is_dir():
            p.error(f"record: {args.path.parent} is not a folder; create it or name another path")
    return args


def main(argv: list[str] | None = None) -> int:
    """Record a snapshot (checked before the minutes the cases take) or compare two."""
    args = parse_args(argv)
    if args.command == "record":
        record(args.path)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
