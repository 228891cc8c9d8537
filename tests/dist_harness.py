"""Spawn a gloo process group on CPU and run one function on every rank.

Starting processes costs seconds (importing torch), so a test runs many cases inside one
spawned group rather than one spawn per case.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 600
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results.

    ``fn`` must be importable from a module (it is pickled by name). A failure on any rank
    raises here with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        collected: dict[int, tuple[bool, Any]] = {}
        while not results.empty():
            rank, ok, payload = results.get()
            collected[rank] = (ok, payload)
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(collected.items()) if not ok]
    if failures:
        raise AssertionError("distributed run failed\n" + "\n".join(failures))
    if alive or len(collected) != world_size:
        raise AssertionError(f"distributed run hung or died: got results from {sorted(collected)}")
    return [collected[r][1] for r in range(world_size)]
