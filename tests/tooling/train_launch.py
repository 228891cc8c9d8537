"""Launching examples/train.py for the tooling tests: under torchrun on CPU/gloo with a tiny
model (``TINY``), or as one plain process, and reading what a run wrote.

``TINY`` runs fp32 communication and fp32 Newton-Schulz, so that runs on different world
sizes differ by fp32 rounding only (test_train_resume_slow.py's docstring says why).

A launch costs about 14 s of which a second or two is training: torchrun's agent and then
every rank import torch (and DCP, dynamo, muon_dist) again. :func:`launch_forked` runs the
same script, as ``__main__``, in ranks forked from dist_harness's forkserver, which imported
those once, with the environment torchrun gives its workers: the files that launch many runs
launch one of them through torchrun, the rest forked.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.multiprocessing as mp
from dist_harness import PRELOAD
from repo_paths import ROOT
from torch.distributed import TCPStore

SCRIPT = ROOT / "examples" / "train.py"
TINY = [
    "--dim", "32",
    "--layers", "2",
    "--heads", "2",
    "--vocab", "64",
    "--seq-len", "32",
    "--batch-size", "6",  # divides 1, 2 and 3 ranks alike; uneven splits work too
    "--steps", "10",
    "--comm-dtype", "fp32",
    "--ns-dtype", "fp32",
    "--no-progress",
    "--no-plot",  # drawing takes seconds a launch: drawn() where a test reads the plot
]  # fmt: skip
LAUNCH_TIMEOUT_S = 300


def launch_env() -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("WORLD_SIZE", None)  # a plain run must take the one-process path
    return env


def drawn(args: Sequence[str]) -> list[str]:
    """``args`` with loss.png drawn."""
    return [a for a in args if a != "--no-plot"]


def launch(nproc: int | None, args: Sequence[str]) -> str:
    """Run train.py on ``nproc`` ranks via torchrun, or as a plain process when None."""
    env = launch_env()
    if nproc is None:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc), str(SCRIPT), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def launch_forked(nproc: int | None, args: Sequence[str], logs: Path, script: Path = SCRIPT) -> str:
    """:func:`launch`'s run, its ranks forked with torch imported (the module's docstring):
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous store, as torchrun sets them,
    or none of them when ``nproc`` is None. Each rank writes its output to
    ``logs/rank<R>.log``; returns them all, rank 0's first. ``script``: another script run
    the same way (a benchmark's).

    This process hosts the store, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``:
    every rank is its client), on a port the kernel picks and the store holds: a port found
    free and then closed could be taken, before rank 0 listened on it, by another test's
    connections (the ephemeral range), which failed the run with ``EADDRINUSE``."""
    logs.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # dist_harness's: one server per test process
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as dist_harness starts the server
    world = nproc or 1
    store = None if nproc is None else TCPStore("localhost", 0, world, True, wait_for_workers=False)
    port = 0 if store is None else store.port
    paths = [logs / f"rank{rank}.log" for rank in range(world)]
    procs = [
        ctx.Process(target=_forked_rank, args=(rank, nproc, port, list(args), paths[rank], script))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    del store  # every rank has exited
    output = "".join(path.read_text() for path in paths if path.exists())
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        raise AssertionError(f"{script.name} {' '.join(args)} exited {codes}\n{output[-8000:]}")
    return output


def _forked_rank(
    rank: int, nproc: int | None, port: int, args: list[str], log: Path, script: Path
) -> None:
    """One rank of :func:`launch_forked`: ``script`` run as ``python script.py`` would."""
    env = launch_env()
    if nproc is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        env.update(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="localhost", MASTER_PORT=str(port))
        env.update(TORCHELASTIC_USE_AGENT_STORE=str(True))
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for stream in (sys.stdout, sys.stderr):  # whole lines: the two streams share the file
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.chdir(ROOT)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def losses(out: Path, optimizer: str = "muon") -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["optimizer"] == optimizer}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in keys)
