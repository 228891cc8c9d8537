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
import sys
import sysconfig
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sources = default_sources() if args.source is None else [s.resolve() for s in args.source]
    for source in sources:
        if not source.is_dir():
            raise SystemExit(f"--source {source} is not a folder")
    args.out.mkdir(parents=True, exist_ok=True)
    stale = sorted(args.out.glob("train_*.bin")) + sorted(args.out.glob("val_*.bin"))
    if stale:
        raise SystemExit(
            f"--out {args.out} already holds shards ({stale[0].name}, ...), which a glob would "
            "mix with the new ones; remove them or choose another --out"
        )

    train = ShardWriter(args.out, "train", args.shard_tokens)
    val = ShardWriter(args.out, "val", args.shard_tokens)
    skipped = {"empty": 0, "with a 0 byte": 0}
    capped = False
    for doc in documents(sources, tuple(args.extensions)):
        text = doc.path.read_bytes()
        if not text:
            skipped["empty"] += 1
            continue
        if SEPARATOR in text:
            skipped["with a 0 byte"] += 1
            continue
        size = len(SEPARATOR) + len(text)
        if args.max_tokens is not None and train.tokens + val.tokens + size > args.max_tokens:
            capped = True
            break
        (val if doc.split_draw < args.val_fraction else train).add(text)
    for split, name in ((train, "train"), (val, "val")):
        if not split.documents:
            for path in train.shards + val.shards:  # written by this run: leave no part
                path.unlink()
            raise SystemExit(
                f"no document went to the {name} split ({train.documents} train, "
                f"{val.documents} val): give more text (--source, --max-tokens) or another "
                "--val-fraction"
            )
        split.close()

    print("sources (in this order):")
    for index, source in enumerate(sources):
        print(f"  {index}: {source}")
    print(
        f"documents: {train.documents:,} train, {val.documents:,} validation; left out: "
        + ", ".join(f"{n:,} {why}" for why, n in skipped.items())
        + ("; stopped at the --max-tokens cap" if capped else "")
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
        f"train with: examples/train.py --data '{args.out / 'train_*.bin'}' "
        f"--eval-data '{args.out / 'val_*.bin'}'"
    )


if __name__ == "__main__":
    main()
