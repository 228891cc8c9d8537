"""Checkpoints of the training example that prove themselves before they are loaded.

A checkpoint is the folder ``step_NNNNNN``: DCP's shards (``__R_N.distcp``), its
``.metadata`` and our ``meta.json``. Every rank writes its shards into
``step_NNNNNN.partial``, then digests the files it wrote itself (the writer's own view of
them, so a file another node sees half-synced cannot be blessed); rank 0 puts every file's
size and digests into ``meta.json``, seals ``meta.json`` with a digest of its own content,
and only then renames the folder. The sizes and digests are so part of what makes a
checkpoint complete.

A resume verifies a checkpoint before DCP reads a byte of it: the files are split across the
ranks (by size, longest first), each rank checks its share, and one collective gives every
rank the same verdict. A checkpoint that fails (a file missing, shorter or longer, a
flipped byte, a ``meta.json`` that is not what rank 0 wrote) or that DCP then cannot read is
never used: the loader falls back to the newest checkpoint that passes, with one warning
naming the folder, the file and the reason; with none left it raises on every rank, naming
each. A checkpoint written before digests existed loads unverified, with an info line.

The digest is CRC-32 (``zlib.crc32``) of each 64 MiB chunk of a file. It is in the standard
library (no new dependency; CRC-32C would need a package), it catches every burst of up to
32 flipped bits and any other damage with probability 1 - 2^-32 per chunk, which is what a
torn, truncated or bit-rotted file needs (this is no defence against an adversary, and needs
none). It runs at memory speed, about 1-2 GB/s a core, and ``zlib`` releases the GIL while
it runs, so the chunks of a rank's files are digested by a few threads at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import traceback
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.nn import Module

log = logging.getLogger(__name__)

META = "meta.json"
"""The file rank 0 writes last: the step, the run's facts, and every other file's digests."""
DCP_METADATA = ".metadata"
"""DCP's index of the shards, written by the coordinator (rank 0) in ``finish``."""
CHUNK_BYTES = 64 << 20
"""Bytes per CRC-32: a damaged chunk is found on its own, and chunks digest in parallel."""
DIGEST_THREADS = 4
"""Threads a rank digests with (``zlib.crc32`` releases the GIL on large buffers)."""
FORMAT = "crc32-chunks-v1"
"""How ``meta.json``'s digests were taken; a loader refuses one it does not know."""


class CheckpointError(RuntimeError):
    """A resume that found checkpoints but none it could load; names each and why."""


@dataclass(frozen=True)
class Problem:
    """Why one checkpoint cannot be loaded: the folder, the file and the reason."""

    folder: Path
    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.folder / self.file}: {self.reason}"


# ---------------------------------------------------------------------------------------
# Digests


def chunk_crcs(path: Path, size: int, pool: ThreadPoolExecutor) -> list[Future[int]]:
    """The CRC-32 of every ``CHUNK_BYTES`` chunk of the first ``size`` bytes of ``path``."""

    def crc(offset: int) -> int:
        with open(path, "rb") as f:
            f.seek(offset)
            return zlib.crc32(f.read(min(CHUNK_BYTES, size - offset)))

    return [pool.submit(crc, offset) for offset in range(0, size, CHUNK_BYTES)]


def digest_files(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "crc32": [per chunk]}}`` of the files ``names`` in ``folder``."""
    sizes = {name: (folder / name).stat().st_size for name in names}
    with ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="digest") as pool:
        pending = {name: chunk_crcs(folder / name, size, pool) for name, size in sizes.items()}
        return {
            name: {"size": sizes[name], "crc32": [f.result() for f in futures]}
            for name, futures in pending.items()
        }


def check_files(folder: Path, expected: dict[str, dict[str, Any]]) -> list[Problem]:
    """The files of ``expected`` that are missing, of another size or another digest."""
    problems, present = [], {}
    for name, want in expected.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            problems.append(Problem(folder, name, "missing"))
            continue
        if size != want["size"]:
            reason = f"{size} bytes, {want['size']} when it was saved (truncated or extended)"
            problems.append(Problem(folder, name, reason))
        else:
            present[name] = want
    if not present:
        return problems
    got = digest_files(folder, present)
    for name, want in present.items():
        bad = [
            i
            for i, (a, b) in enumerate(zip(got[name]["crc32"], want["crc32"], strict=True))
            if a != b
        ]
        if bad:
            first, end = bad[0] * CHUNK_BYTES, min((bad[0] + 1) * CHUNK_BYTES, want["size"])
            reason = f"digest mismatch: bytes {first}-{end - 1} changed since the save"
            problems.append(Problem(folder, name, reason))
    return problems


def shares(files: dict[str, dict[str, Any]], world_size: int) -> list[list[str]]:
    """The files split over ``world_size`` ranks by size, largest first onto the rank with
    the fewest bytes so far: every rank gets its share the same way."""
    loads = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        rank = loads.index(min(loads))
        out[rank].append(name)
        loads[rank] += files[name]["size"]
    return out


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``meta_crc32``: the digest of the rest, so a changed byte is seen."""
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return {**body, "meta_crc32": zlib.crc32(json.dumps(body, sort_keys=True).encode())}


def read_meta(folder: Path) -> tuple[dict[str, Any] | None, Problem | None]:
    """``folder``'s ``meta.json``, checked against its seal, or why it cannot be used."""
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        return None, Problem(folder, META, "missing")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, Problem(folder, META, f"unreadable ({error})")
    if not isinstance(meta, dict) or not {"step", "elapsed", "world_size"} <= meta.keys():
        return None, Problem(folder, META, "not a checkpoint's meta.json (step, elapsed, ...)")
    if "meta_crc32" not in meta and "files" not in meta:
        return meta, None  # written before checkpoints carried digests
    if meta != seal(meta):
        return None, Problem(folder, META, "its content does not match its own digest")
    if meta.get("digest") != FORMAT:
        return None, Problem(folder, META, f"digest format {meta.get('digest')!r}, not {FORMAT}")
    return meta, None


# ---------------------------------------------------------------------------------------
# Saving


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, keeping the names of the files this rank wrote: those it digests."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        names = {result.storage_data.relative_path for result in future.wait()}
        self.written += sorted(names)
        return future

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.written.append(DCP_METADATA)


def save_checkpoint(
    path: Path, model: Module, opt: torch.optim.Optimizer, meta: dict[str, Any]
) -> None:
    """DCP save of sharded model and optimizer state into ``path``, atomically, with digests.

    Every rank writes its shards into ``<path>.partial`` and digests the files it wrote;
    rank 0 gathers the digests into ``meta.json``, seals it, and renames the folder to
    ``path``, so a save cut off leaves a ``.partial`` folder that is never loaded.
    ``get_state_dict`` keys the optimizer state by parameter FQN and keeps the Muon momenta
    as DTensors, so DCP stores each shard once and can reshard them on load.
    """
    began = time.perf_counter()
    main = dist.get_rank() == 0
    partial = path.with_name(f"{path.name}.partial")
    if main and partial.exists():
        shutil.rmtree(partial)  # left by a save of this step that was cut off
    dist.barrier()
    writer = RecordingWriter(partial)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
    written = time.perf_counter()
    mine = digest_files(partial, writer.written)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, time.perf_counter() - written))
    files = {name: entry for part, _ in gathered for name, entry in part.items()}
    digest_s = max(seconds for _, seconds in gathered)
    if main:
        sealed = seal({**meta, "digest": FORMAT, "files": files})
        write_synced(partial / META, json.dumps(sealed, indent=1))
        if path.exists():
            shutil.rmtree(path)  # a re-run of this step after a resume replaces it
        partial.rename(path)
        sync_folder(path.parent)
    dist.barrier()
    if main:
        size = sum(entry["size"] for entry in files.values())
        log.info(
            "saved %s: %.2f s (DCP write %.2f s; digests of %d files, %.1f MB, %.2f s on the "
            "slowest rank)",
            path, time.perf_counter() - began, written - began, len(files), size / 1e6, digest_s,
        )  # fmt: skip


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to storage before the folder is renamed."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (the rename) to storage."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Loading


def complete_checkpoints(root: Path) -> list[Path]:
    """The ``step_NNNNNN`` folders of ``root``, newest first (a save cut off leaves only a
    ``.partial`` folder, never one of these)."""
    done = [p for p in root.glob("step_*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(done, reverse=True)


def agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one broadcast)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(mine: Sequence[Problem]) -> Problem | None:
    """The first problem any rank found, the same on every rank (one all-gather)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(mine))
    found = [problem for part in gathered for problem in part]
    return min(found, key=lambda p: p.file) if found else None


def verify(folder: Path) -> tuple[dict[str, Any] | None, Problem | None]:
    """``folder``'s meta (rank 0's read of it) and the verdict every rank agrees on."""
    meta, problem = agreed(read_meta(folder) if dist.get_rank() == 0 else None)
    if problem is not None or "files" not in meta:
        return meta, problem
    began = time.perf_counter()
    share = shares(meta["files"], dist.get_world_size())[dist.get_rank()]
    problem = first_problem(check_files(folder, {n: meta["files"][n] for n in share}))
    if dist.get_rank() == 0 and problem is None:
        size = sum(entry["size"] for entry in meta["files"].values())
        log.info(
            "verified %s: %d files, %.1f MB, sizes and digests as saved (%.2f s)",
            folder, len(meta["files"]), size / 1e6, time.perf_counter() - began,
        )  # fmt: skip
    return meta, problem


def failure(error: BaseException) -> str:
    """One line per failing rank of an exception of DCP (or the one exception)."""
    if isinstance(error, CheckpointException):
        lines = []
        for rank, (exc, _) in sorted(error.failures.items()):
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            lines.append(f"rank {rank}: {text.splitlines()[-1]}")
        return "; ".join(lines)
    return "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1]


def try_load(folder: Path, model: Module, opt: torch.optim.Optimizer) -> Problem | None:
    """Load ``folder`` into ``model`` and ``opt``; the agreed problem if DCP failed anywhere."""
    began = time.perf_counter()
    reason = None
    try:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (Exception, CheckpointException) as error:
        reason = f"DCP could not load it ({failure(error)})"
    problem = first_problem([] if reason is None else [Problem(folder, "", reason)])
    if dist.get_rank() == 0 and problem is None:
        log.info("loaded %s: %.2f s", folder, time.perf_counter() - began)
    return problem


def load_latest(
    root: Path, model: Module, opt: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint of ``root`` that verifies and loads; None if ``root`` has
    none at all. Each one passed over gets one warning; none good raises on every rank."""
    candidates: list[Path] = agreed(complete_checkpoints(root) if dist.get_rank() == 0 else None)
    rejected: list[Problem] = []
    for index, folder in enumerate(candidates):
        meta, problem = verify(folder)
        if problem is None and meta is not None and "files" not in meta and dist.get_rank() == 0:
            log.info(
                "%s has no digests (saved before they were kept): loading it unverified", folder
            )
        if problem is None:
            problem = try_load(folder, model, opt)
        if problem is None and meta is not None:
            return folder, meta
        assert problem is not None
        rejected.append(problem)
        if dist.get_rank() == 0 and index + 1 < len(candidates):
            log.warning(
                "checkpoint %s is not loaded (%s); falling back to %s",
                folder, problem, candidates[index + 1].name,
            )  # fmt: skip
    if not rejected:
        return None
    raise CheckpointError(
        f"--resume: no checkpoint in {root} can be loaded; "
        + "; ".join(str(p) for p in rejected)
        + ". Restore a good copy of one, or start afresh with another --ckpt-dir"
    )
