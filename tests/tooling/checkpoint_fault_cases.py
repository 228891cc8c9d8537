"""Worker of test_checkpoint_faults_slow.py: every checkpoint fault, resumed on 2 gloo ranks in
one torchrun launch (a launch costs seconds; a case, a fraction of one).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/tooling/checkpoint_fault_cases.py OUT

Each rank joins the group once and runs examples/train.py's own ``train()``: first the
uninterrupted run, which checkpoints steps 2 and 4 (``OUT/ckpt``) and saves its final weights
(``OUT/reference.pt``); then, per case of :data:`CASES`, a resume from a copy of those
checkpoints with files damaged as the case says, saving its final weights to
``OUT/<case>/final.pt``; last, a ``--data`` run whose file rank 0 truncates after it was
opened. Each rank writes what it saw to ``OUT/rank<R>.json``: per case the error it raised
(or None), the steps it trained and the checkpoint module's log lines.

The damage functions are used by test_checkpoint_verify.py too, in process.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
CKPT_EVERY = 2
NEWEST, OLDER = "step_000004", "step_000002"
SHARD = "__1_0.distcp"  # rank 1's shard: rank 0 verifies it when the two files split so


def flip(path: Path) -> None:
    """XOR 64 bytes in the middle of the file (one digit of ``meta.json``: a flip that
    leaves it valid JSON, found only by its seal)."""
    data = bytearray(path.read_bytes())
    if path.name == "meta.json":
        at = data.index(b'"elapsed": ') + len(b'"elapsed": ')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
    else:
        middle = len(data) // 2
        for i in range(middle, min(middle + 64, len(data))):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    """Keep the first half of the file (a save cut off while the file was synced)."""
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def delete(path: Path) -> None:
    path.unlink()


def garbage(path: Path) -> None:
    """Replace the file's content by bytes no reader understands."""
    path.write_bytes(b"\x00\xff not a checkpoint file {\n" * 3)


def strip_digests(path: Path) -> None:
    """``meta.json`` as checkpoints had it before they carried digests."""
    meta = json.loads(path.read_text())
    for key in ("digest", "files", "meta_crc32"):
        meta.pop(key)
    path.write_text(json.dumps(meta, indent=1))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped": flip,
    "truncated": truncate,
    "deleted": delete,
    "garbage": garbage,
}
FILES = {"distcp": SHARD, "metadata": ".metadata", "meta": "meta.json"}


@dataclass(frozen=True)
class Case:
    """Damage done to copies of the checkpoints, and what a resume must do with them:
    ``"fallback"`` to step 2, load the ``"newest"`` (step 4) or stop with an ``"error"``."""

    name: str
    edits: tuple[tuple[str, str, Callable[[Path], None]], ...]  # (folder, file, damage)
    expect: str
    named: tuple[str, ...] = ()  # what the warning or the error must name


CASES = [
    *(
        Case(f"{how}_{kind}", ((NEWEST, file, damage),), "fallback", (f"{NEWEST}/{file}",))
        for kind, file in FILES.items()
        for how, damage in DAMAGE.items()
    ),
    Case(
        "none_left",
        ((NEWEST, SHARD, flip), (OLDER, "meta.json", garbage)),
        "error",
        (f"{NEWEST}/{SHARD}", f"{OLDER}/meta.json"),
    ),
    Case("old_format", ((NEWEST, "meta.json", strip_digests),), "newest"),
    Case(
        "old_format_truncated",
        ((NEWEST, "meta.json", strip_digests), (NEWEST, SHARD, truncate)),
        "fallback",
        (NEWEST, "DCP could not load it"),
    ),
]


class Lines(logging.Handler):
    """Keeps ``LEVEL message`` of every record it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@contextmanager
def captured(logger: logging.Logger) -> Iterator[list[str]]:
    handler = Lines()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def flags(out: Path, *extra: str) -> list[str]:
    from train_launch import TINY

    return [*TINY, "--steps", str(STEPS), "--out", str(out / "out"), *extra]


def run(train: Any, env: Any, mesh: Any, argv: list[str]) -> dict[str, Any]:
    """``train()`` of ``argv``: its error (or None), steps and the checkpoint log lines."""
    import torch.distributed as dist

    args = train.parse_args(argv)
    if env.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
    data = train.open_data(args)[0]
    dist.barrier()
    with captured(logging.getLogger("checkpoint")) as lines:
        try:
            records = train.train("muon", args, env, mesh, data)
        except RuntimeError as error:
            return {"error": str(error), "steps": [], "logs": lines}
    return {"error": None, "steps": [r["step"] for r in records], "logs": lines}


def damaged(out: Path, case: Case, env: Any) -> Path:
    """A copy of the uninterrupted run's checkpoints with ``case``'s damage (rank 0 does it)."""
    import torch.distributed as dist

    folder = out / case.name
    if env.is_main:
        shutil.copytree(out / "ckpt", folder / "ckpt")
        for step, file, damage in case.edits:
            damage(folder / "ckpt" / step / file)
    dist.barrier()
    return folder


def shrinking_data(train: Any, env: Any, mesh: Any, out: Path) -> dict[str, Any]:
    """A ``--data`` run whose file rank 0 cuts to 100 bytes once every rank has mapped it."""
    import torch.distributed as dist

    text = out / "text.txt"
    if env.is_main:
        text.write_bytes(bytes(range(32, 127)) * 100)
    dist.barrier()
    argv = flags(out / "shrink", "--data", str(text), "--vocab", "256", "--eval-batches", "1")
    args = train.parse_args(argv)
    data = train.open_data(args)[0]
    dist.barrier()
    if env.is_main:
        args.out.mkdir(parents=True)
        with text.open("r+b") as f:
            f.truncate(100)
    dist.barrier()
    try:
        train.train("muon", args, env, mesh, data)
    except RuntimeError as error:
        return {"error": str(error), "size": len(bytes(range(32, 127))) * 100}
    return {"error": None}


def main(out: Path) -> None:
    sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "support")]
    import torch.distributed as dist
    import train

    logging.getLogger("checkpoint").setLevel(logging.INFO)
    env = train.init_distributed()
    try:
        mesh = train.build_mesh(env, 1)
        ckpt = ["--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", str(out / "ckpt")]
        reference = run(train, env, mesh, flags(out, *ckpt, "--save-final", f"{out}/reference.pt"))
        results: dict[str, Any] = {"reference": reference}
        for case in CASES:
            folder = damaged(out, case, env)
            resume = ["--ckpt-dir", str(folder / "ckpt"), "--resume"]
            argv = flags(folder, *resume, "--save-final", str(folder / "final.pt"))
            results[case.name] = run(train, env, mesh, argv)
        results["shrinking_data"] = shrinking_data(train, env, mesh, out)
        (out / f"rank{env.rank}.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
