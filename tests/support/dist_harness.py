"""Run functions on every rank of a process group that stays up for the whole test session.

Starting a rank costs seconds (importing torch), so each world size gets one pool of ranks,
started on first use and kept until the session ends; every test case is one request to it
and so gets its own test id. A request that fails or times out on any rank takes the pool
down (its collectives may be out of step), and the next request starts a fresh one. The
ranks are forked from one forkserver per test process that has imported torch and
muon_dist once, instead of each rank importing them again.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# After the first rank reports a failure, how long the others get to report theirs.
FAILURE_GRACE_S = 10.0
# What the forkserver imports before it forks any rank: every rank of every pool needs them,
# and importing them costs seconds a process on CPU (torch._dynamo comes in lazily, through
# fully_shard). The server only imports them and forks, as DataLoader's fork workers do
# after torch is imported; no rank inherits a process group or a tensor.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo"]
PRELOAD += ["muon_dist", __name__]


def _serve(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    tasks: Any,
    results: Any,
) -> None:
    """Join the group, then run each ``(task_id, fn, args)`` from ``tasks`` until ``None``."""
    torch.set_num_threads(1)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
            device_id=device,
        )
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    try:
        while (task := tasks.get()) is not None:
            task_id, fn, args = task
            try:
                results.put((task_id, rank, True, fn(rank, world_size, *args)))
            except BaseException:
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned ranks in one process group (gloo on CPU, or NCCL, one GPU each)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise RuntimeError(
                f"a {world_size}-rank NCCL pool needs {world_size} GPUs, "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.world_size = world_size
        self.backend = backend
        self._next_task = 0
        self._tmp = tempfile.mkdtemp(prefix="muon_dist_pool_")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts
        # The server, started with the first rank, passes this environment to every rank.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        store = os.path.join(self._tmp, "store")
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, backend, store, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank; return the per-rank results.

        ``fn`` must be importable from a module (it is pickled by name). A failure on any rank
        raises here with that rank's traceback and closes the pool.
        """
        task_id = self._next_task
        self._next_task += 1
        for tasks in self._tasks:
            tasks.put((task_id, fn, args))
        collected: dict[int, tuple[bool, Any]] = {}
        wait = timeout
        while len(collected) < self.world_size:
            try:
                got_id, rank, ok, payload = self._results.get(timeout=wait)
            except queue.Empty:
                break
            if got_id not in (task_id, None):
                continue
            collected[rank] = (ok, payload)
            if not ok:
                wait = FAILURE_GRACE_S
        failures = [f"rank {r}:\n{p}" for r, (ok, p) in sorted(collected.items()) if not ok]
        if failures or len(collected) < self.world_size:
            self.close()
        if failures:
            raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(failures))
        if len(collected) < self.world_size:
            raise AssertionError(
                f"{fn.__name__} hung or died after {timeout:.0f} s: "
                f"results from ranks {sorted(collected)} of {self.world_size}"
            )
        return [collected[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the rendezvous file."""
        self.stop()
        self.join()

    def stop(self) -> None:
        """Ask every rank to leave the group and exit; ``join`` waits for them."""
        for p, tasks in zip(self._procs, self._tasks, strict=True):
            if p.is_alive():
                tasks.put(None)

    def join(self, timeout: float = 3) -> None:
        """Wait up to ``timeout`` s in all for the ranks to exit, then end the rest: they hold
        nothing worth a slow interpreter shutdown on a loaded machine."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._tmp, ignore_errors=True)


_POOLS: dict[tuple[int, str], WorkerPool] = {}


def pool(world_size: int, backend: str = "gloo") -> WorkerPool:
    """The session's pool for this world size and backend, started (again) if needed."""
    key = (world_size, backend)
    current = _POOLS.get(key)
    if current is None or not current.alive:
        if current is not None:
            current.close()
        current = _POOLS[key] = WorkerPool(world_size, backend)
    return current


def close_pools() -> None:
    """Stop every pool: all are asked at once, then awaited."""
    pools = list(_POOLS.values())
    _POOLS.clear()
    for p in pools:
        p.stop()
    for p in pools:
        p.join()


def run_distributed(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on the session's ``world_size``-rank gloo pool."""
    return pool(world_size).run(fn, *args, timeout=timeout)
