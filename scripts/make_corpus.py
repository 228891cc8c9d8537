"""Write a train/validation text corpus from files already on this machine; download nothing.

By default the text is the ``.py``, ``.md``, ``.rst`` and ``.txt`` files of the Python
standard library and of the environment's site-packages (torch, numpy, ... and this
project's other dependencies); ``--source DIR`` names other folders. Each file is a
document. Documents are taken in the order of the SHA-256 of their path relative to their
source folder (a fixed shuffle, so a ``--max-tokens`` cap samples every package rather than
the first ones alphabetically), and another part of that hash puts a ``--val-fraction`` of
them in the validation split. Nested ``site-packages`` / ``dist-packages`` folders,
``__pycache__``, hidden folders, symbolic links, pip's ``__editable__*`` finders (they hold
the path of a checkout), empty files and files containing a 0 byte are left out.

Tokens are byte-level: one token per byte (vocabulary 256), with a 0 byte before each
document as its separator (GPT-2 shards put ``<|endoftext|>`` there). They are written as
``.bin`` shards in the llm.c / modded-nanogpt layout (256 int32 header: magic 20240520,
version 1, token count; then uint16 tokens), which ``examples/train.py --data`` reads::

    python scripts/make_corpus.py --out corpus
    torchrun --standalone --nproc-per-node 2 examples/train.py \\
        --data 'corpus/train_*.bin' --eval-data 'corpus/val_*.bin'

The output is deterministic given the same files: the same Python and package versions give
the same shards and checksum on any machine, wherever they are installed; another version of
any package (or of Python) gives another corpus and another checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from corpus import BYTE_VOCAB, HEADER_BYTES, write_bin

EXTENSIONS = (".py", ".md", ".rst", ".txt")
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SEPARATOR = b"\0"


def default_sources() -> list[Path]:
    """The standard library and the environment's site-packages (pure and platform)."""
    paths = sysconfig.get_paths()
    roots = [Path(paths[key]).resolve() for key in ("stdlib", "purelib", "platlib")]
    return list(dict.fromkeys(roots))


def walk(root: Path, extensions: tuple[str, ...]) -> Iterator[Path]:
    """Regular files under ``root`` with one of ``extensions``; symbolic links, editable
    finders, nested package folders, caches and hidden folders left out."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        for name in files:
            path = Path(folder) / name
            editable = name.startswith("__editable__")  # holds the checkout's path
            if path.suffix in extensions and not path.is_symlink() and not editable:
                yield path


@dataclass(order=True)
class Document:
    """A file to include, keyed by the hash of ``(source index, relative path)``."""

    digest: bytes
    path: Path = field(compare=False)

    @property
    def split_draw(self) -> float:
        """Uniform in [0, 1), from hash bytes the order does not lean on: below
        ``--val-fraction``, the document goes to the validation split."""
        return int.from_bytes(self.digest[8:16], "big") / 2**64


def documents(sources: list[Path], extensions: tuple[str, ...]) -> list[Document]:
    """Every candidate file of every source, in hash order."""
    found = []
    for index, root in enumerate(sources):
        for path in walk(root, extensions):
            key = f"{index}/{path.relative_to(root).as_posix()}".encode()
            found.append(Document(hashlib.sha256(key).digest(), path))
    return sorted(found)


class ShardWriter:
    """Byte-level tokens into ``{prefix}_{NNNNNN}.bin`` shards of ``shard_tokens`` each."""

    def __init__(self, out: Path, prefix: str, shard_tokens: int) -> None:
        self.out, self.prefix, self.shard_tokens = out, prefix, shard_tokens
        self.buffer = bytearray()
        self.shards: list[Path] = []
        self.tokens = 0
        self.documents = 0

    def add(self, text: bytes) -> None:
        self.buffer += SEPARATOR + text
        self.tokens += len(SEPARATOR) + len(text)
        self.documents += 1
        while len(self.buffer) >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> None:
        if self.buffer:
            self._flush(len(self.buffer))

    def _flush(self, size: int) -> None:
        path = self.out / f"{self.prefix}_{len(self.shards):06d}.bin"
        write_bin(path, np.frombuffer(bytes(self.buffer[:size]), dtype=np.uint8))
        del self.buffer[:size]
        self.shards.append(path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the .bin shards")
    p.add_argument(
        "--source",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="folder of text files, repeatable (default: the standard library and"
        " site-packages of this Python)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="stop before the first document that would take the corpus (train and"
        " validation, separators included) past this many tokens (default: no cap)",
    )
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of the documents")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    p.add_argument(
        "--extensions",
        nargs="+",
        default=list(EXTENSIONS),
        help=f"file endings to read (default: {' '.join(EXTENSIONS)})",
    )
    args = p.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction {args.val_fraction} must lie in (0, 1)")
    if args.shard_tokens < 1:
        p.error(f"--shard-tokens {args.shard_tokens} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens {args.max_tokens} must be >= 1")
    return args


@dataclass
class Selection:
    """The documents of each split, in order, with what was left out and why."""

    train: list[Path] = field(default_factory=list)
    val: list[Path] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "with a 0 byte": 0})
    capped: bool = False


def select(sources: list[Path], args: argparse.Namespace) -> Selection:
    """Which documents go to which split: decided before anything is written, so a corpus
    that would lack a split is refused without leaving a folder behind."""
    chosen = Selection()
    tokens = 0
    for doc in documents(sources, tuple(args.extensions)):
        text = doc.path.read_bytes()
        if not text:
            chosen.skipped["empty"] += 1
            continue
        if SEPARATOR in text:
            chosen.skipped["with a 0 byte"] += 1
            continue
        size = len(SEPARATOR) + len(text)
        if args.max_tokens is not None and tokens + size > args.max_tokens:
            chosen.capped = True
            break
        tokens += size
        (chosen.val if doc.split_draw < args.val_fraction else chosen.train).append(doc.path)
    return chosen


def write(folder: Path, chosen: Selection, shard_tokens: int) -> tuple[ShardWriter, ShardWriter]:
    """Both splits' shards into ``folder``."""
    splits = []
    for name, paths in (("train", chosen.train), ("val", chosen.val)):
        writer = ShardWriter(folder, name, shard_tokens)
        for path in paths:
            text = path.read_bytes()
            if not text or SEPARATOR in text:
                raise SystemExit(f"{path} changed while the corpus was written; run it again")
            writer.add(text)
        writer.close()
        splits.append(writer)
    return splits[0], splits[1]


def check_out(out: Path) -> None:
    """``--out`` must not exist, or be an empty folder: the corpus never mixes with (or
    replaces) files that are there."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        held = "a file" if not out.is_dir() else f"{next(out.iterdir()).name}, ..."
        raise SystemExit(
            f"--out {out} already exists and is not an empty folder (it holds {held}); "
            "choose another --out, or move that one away"
        )


def written(out: Path, chosen: Selection, shard_tokens: int) -> tuple[ShardWriter, ShardWriter]:
    """Write into a fresh hidden sibling of ``out`` and rename it to ``out`` once whole: a run
    cut off leaves no half corpus under the name a glob would read."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        train, val = write(scratch, chosen, shard_tokens)
        scratch.rename(out)  # replaces an empty folder, fails on anything else
    except BaseException:
        shutil.rmtree(scratch)  # this run's own scratch folder, never a path it was given
        raise
    for split in (train, val):
        split.shards = [out / path.name for path in split.shards]
    return train, val


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sources = default_sources() if args.source is None else [s.resolve() for s in args.source]
    for source in sources:
        if not source.is_dir():
            raise SystemExit(f"--source {source} is not a folder")
    check_out(args.out)
    chosen = select(sources, args)
    for name, paths in (("train", chosen.train), ("val", chosen.val)):
        if not paths:
            raise SystemExit(
                f"no document went to the {name} split ({len(chosen.train)} train, "
                f"{len(chosen.val)} val): give more text (--source, --max-tokens) or another "
                "--val-fraction"
            )
    train, val = written(args.out, chosen, args.shard_tokens)
    report(sources, chosen, train, val, args.out)


def report(
    sources: list[Path], chosen: Selection, train: ShardWriter, val: ShardWriter, out: Path
) -> None:
    """Sources, documents, every shard's size and SHA-256, and the corpus checksum."""
    print("sources (in this order):")
    for index, source in enumerate(sources):
        print(f"  {index}: {source}")
    print(
        f"documents: {train.documents:,} train, {val.documents:,} validation; left out: "
        + ", ".join(f"{n:,} {why}" for why, n in chosen.skipped.items())
        + ("; stopped at the --max-tokens cap" if chosen.capped else "")
    )
    total = hashlib.sha256()
    for split in (train, val):
        for path in split.shards:
            digest = sha256_file(path)
            total.update(bytes.fromhex(digest))
            tokens = (path.stat().st_size - HEADER_BYTES) // 2
            print(f"  {path}  {tokens:,} tokens  sha256 {digest}")
    print(
        f"train {train.tokens:,} tokens in {len(train.shards)} shard(s), validation "
        f"{val.tokens:,} in {len(val.shards)}; byte-level, vocabulary {BYTE_VOCAB}"
    )
    print(f"corpus sha256 (of the shard hashes above, in order): {total.hexdigest()}")
    print(
        f"train with: examples/train.py --data '{out / 'train_*.bin'}' "
        f"--eval-data '{out / 'val_*.bin'}'"
    )


if __name__ == "__main__":
    main()
