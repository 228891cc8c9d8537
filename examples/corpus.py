"""Real text for the training example: memory-mapped token files, batches by ``(seed, step)``.

Two kinds of files are read, both memory-mapped (``numpy.memmap``), so a corpus of any size
costs only the pages a batch touches:

- ``.bin`` token shards in the llm.c / modded-nanogpt layout: a header of 256 little-endian
  int32 (magic 20240520, version 1, token count), then the tokens as uint16. FineWeb shards
  from modded-nanogpt's ``data/cached_fineweb10B.py`` hold GPT-2 tokens (vocabulary 50257);
  ``scripts/make_corpus.py`` writes byte-level ones (vocabulary 256).
- any other file is read as bytes, one token per byte (byte-level, vocabulary 256), so
  plain text needs no tokenizer.

A pattern names one file or a glob of several; the files are concatenated in sorted path
order into one token stream. Batches are windows of ``seq_len + 1`` tokens. The window of
global row ``r`` at training step ``s`` starts at an offset drawn from a generator seeded by
``(seed, s, r)``: a rank reads its own rows only, and the rows do not depend on the number
of ranks or on the steps before, so a run resumed on any number of ranks reads exactly the
batches an uninterrupted run reads. Evaluation windows are fixed: spread evenly over the
held-out tokens, the same in every run whatever its seed.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = 20240520
"""First header int32 of a ``.bin`` token shard (llm.c, modded-nanogpt)."""
VERSION = 1
"""Header version of uint16 token shards (llm.c's version 2 holds uint32 tokens)."""
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BYTE_VOCAB = 256
"""Vocabulary of byte-level tokens: one token per byte value."""


def write_bin(path: Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` (integers in [0, 65535]) as one ``.bin`` shard."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(np.uint16).max):
        raise ValueError(f"{path}: tokens must lie in [0, 65535] to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_bin(path: Path, flag: str) -> np.ndarray:
    """The tokens of one ``.bin`` shard as a read-only uint16 memmap, header checked."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(
            f"{flag} {path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header of a "
            "token shard; only llm.c / modded-nanogpt .bin shards may end in .bin (rename a "
            "text file to read it as bytes)"
        )
    magic, version, count = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != MAGIC:
        raise ValueError(
            f"{flag} {path}: header magic {magic}, expected {MAGIC} (llm.c / modded-nanogpt "
            "token shard); rename a text file so it does not end in .bin to read it as bytes"
        )
    if version != VERSION:
        raise ValueError(
            f"{flag} {path}: header version {version}; only version {VERSION} (uint16 tokens) "
            "is read, write the shard with 16-bit tokens"
        )
    if size != HEADER_BYTES + 2 * count:
        raise ValueError(
            f"{flag} {path}: the header counts {count} tokens ({HEADER_BYTES + 2 * count} "
            f"bytes with the header) but the file has {size} bytes: truncated or not a shard"
        )
    return _map(path, np.dtype("<u2"), HEADER_BYTES, count)


def read_bytes(path: Path) -> np.ndarray:
    """Any file as byte-level tokens: a read-only uint8 memmap."""
    return _map(path, np.dtype(np.uint8), 0, path.stat().st_size)


def _map(path: Path, dtype: np.dtype[Any], offset: int, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map zero bytes; an empty file adds no tokens
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def check_unchanged(part: np.ndarray) -> None:
    """Refuse to read a memory-mapped file that is now shorter than what was mapped.

    Reading a page of a mapping past the file's new end is a SIGBUS that kills the process
    without a word; one ``os.stat`` per file a window touches (microseconds) turns a file
    truncated or rewritten under the job into an error naming it and both sizes.
    """
    if not isinstance(part, np.memmap) or part.filename is None:
        return
    mapped = part.offset + part.nbytes
    size = os.stat(part.filename).st_size
    if size < mapped:
        raise RuntimeError(
            f"data file {part.filename} shrank while the job ran: {mapped} bytes when it was "
            f"opened, {size} bytes now (truncated or rewritten); restore it, then resume from "
            "the last checkpoint (--resume)"
        )


def resolve(pattern: str, flag: str) -> list[Path]:
    """The files ``pattern`` names (one path or a glob, ``**`` included), sorted."""
    if Path(pattern).is_file():
        return [Path(pattern)]
    if Path(pattern).is_dir():
        raise ValueError(
            f"{flag} {pattern} is a directory; name its files with a glob, e.g. "
            f"{flag} '{Path(pattern) / '*.bin'}'"
        )
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"{flag} {pattern!r} matches no file; check the path or the glob")
    return files


class TokenStream:
    """Files concatenated in order into one read-only token sequence, or a range of one."""

    def __init__(self, parts: list[np.ndarray], begin: int = 0, end: int | None = None) -> None:
        self._parts = [p for p in parts if p.size]
        self._starts = np.cumsum([0] + [p.size for p in self._parts])
        total = int(self._starts[-1])
        self.begin = begin
        self.end = total if end is None else end
        if not 0 <= self.begin <= self.end <= total:
            raise ValueError(f"range [{begin}, {end}) outside a stream of {total} tokens")

    def __len__(self) -> int:
        return self.end - self.begin

    def span(self, begin: int, end: int) -> TokenStream:
        """Tokens ``[begin, end)`` of this stream (the files stay mapped, nothing is copied)."""
        if not 0 <= begin <= end <= len(self):
            raise ValueError(f"range [{begin}, {end}) outside a stream of {len(self)} tokens")
        return TokenStream(self._parts, self.begin + begin, self.begin + end)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across file boundaries if need be."""
        if not 0 <= start <= start + length <= len(self):
            raise ValueError(
                f"window [{start}, {start + length}) outside a stream of {len(self)} tokens"
            )
        out = np.empty(length, dtype=np.int64)
        pos, done = self.begin + start, 0
        part = int(np.searchsorted(self._starts, pos, side="right")) - 1
        last = int(np.searchsorted(self._starts, pos + length - 1, side="right")) - 1
        for mapped in self._parts[part : last + 1]:
            check_unchanged(mapped)
        while done < length:
            offset = pos - int(self._starts[part])
            take = min(length - done, self._parts[part].size - offset)
            out[done : done + take] = self._parts[part][offset : offset + take]
            pos, done, part = pos + take, done + take, part + 1
        return out


@dataclass(frozen=True)
class Source:
    """The tokens of one ``--data`` or ``--eval-data`` pattern."""

    pattern: str
    files: list[Path]
    tokens: TokenStream
    byte_level: bool
    """True for byte-level files (vocabulary 256), False for ``.bin`` token shards."""

    def describe(self) -> str:
        kind = "byte-level (vocabulary 256)" if self.byte_level else ".bin token shards"
        return f"{self.pattern}: {len(self.files)} file(s), {len(self.tokens):,} tokens, {kind}"


def open_source(pattern: str, flag: str) -> Source:
    """Map the files of ``pattern``: all ``.bin`` token shards, or all read as bytes."""
    files = resolve(pattern, flag)
    shards = [f for f in files if f.suffix == ".bin"]
    if shards and len(shards) != len(files):
        raise ValueError(
            f"{flag} {pattern!r} matches both .bin token shards ({shards[0]}) and other files "
            f"({next(f for f in files if f.suffix != '.bin')}), which would be read as bytes; "
            "narrow the glob to one kind"
        )
    if shards:
        parts = [read_bin(f, flag) for f in files]
    else:
        parts = [read_bytes(f) for f in files]
    return Source(pattern, files, TokenStream(parts), byte_level=not shards)


@dataclass(frozen=True)
class Corpus:
    """Training and evaluation batches of real tokens, as pure functions of their index.

    ``source`` holds the training tokens and ``held_out`` the evaluation ones (named
    ``held_out_name`` in messages); ``vocab_size`` is the model's vocabulary, which every
    token must be below (checked on each batch for ``.bin`` shards, whose vocabulary their
    header does not state; byte-level data needs 256).
    """

    source: Source
    held_out: TokenStream
    held_out_name: str
    seq_len: int
    vocab_size: int
    seed: int

    def __post_init__(self) -> None:
        seq_len, vocab_size, train = self.seq_len, self.vocab_size, self.source
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed}: the data's generators need a seed >= 0")
        if train.byte_level and vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"--vocab {vocab_size} is smaller than the {BYTE_VOCAB} byte values of "
                f"--data {train.pattern} (read byte-level); pass --vocab {BYTE_VOCAB} or more"
            )
        window = seq_len + 1
        named = (("--data " + train.pattern, train.tokens), (self.held_out_name, self.held_out))
        for name, tokens in named:
            if len(tokens) < window:
                raise ValueError(
                    f"{name} has {len(tokens)} tokens, fewer than the --seq-len {seq_len} + 1 "
                    "that one sequence needs; use more text or a smaller --seq-len (held out: "
                    "a larger --eval-fraction, or --eval-data)"
                )

    def batch(self, step: int, batch_size: int, rows: slice) -> np.ndarray:
        """Rows ``rows`` of the ``[batch_size, seq_len + 1]`` int64 training batch of ``step``.

        Global row ``r`` starts at an offset drawn uniformly from the training tokens by a
        generator seeded by ``(seed, step, r)``.
        """
        last_start = len(self.source.tokens) - (self.seq_len + 1)
        starts = [
            int(np.random.default_rng((self.seed, step, r)).integers(0, last_start + 1))
            for r in range(batch_size)[rows]
        ]
        return self._windows(self.source.tokens, starts, f"training step {step}")

    def eval_batch(self, index: int, batch_size: int, rows: slice, n_batches: int) -> np.ndarray:
        """Rows ``rows`` of evaluation batch ``index`` of ``n_batches``.

        The ``n_batches * batch_size`` evaluation windows start at evenly spaced offsets of
        the held-out tokens, first and last windows at its two ends; they overlap when the
        held-out split is shorter than they are together.
        """
        if not 0 <= index < n_batches:
            raise ValueError(f"evaluation batch {index} outside [0, {n_batches})")
        last_start = len(self.held_out) - (self.seq_len + 1)
        total = n_batches * batch_size
        starts = [
            (index * batch_size + r) * last_start // max(1, total - 1)
            for r in range(batch_size)[rows]
        ]
        return self._windows(self.held_out, starts, f"evaluation batch {index}")

    def _windows(self, tokens: TokenStream, starts: list[int], what: str) -> np.ndarray:
        batch = np.stack([tokens.read(s, self.seq_len + 1) for s in starts])
        top = int(batch.max())
        if top >= self.vocab_size:
            raise ValueError(
                f"token id {top} in {what} of --data {self.source.pattern} is outside --vocab "
                f"{self.vocab_size}; pass a --vocab above the data's largest token id (GPT-2 "
                "shards such as FineWeb's: --vocab 50304)"
            )
        return batch


def open_corpus(
    data: str,
    eval_data: str | None,
    eval_fraction: float,
    seq_len: int,
    vocab_size: int,
    seed: int,
) -> Corpus:
    """The corpus of ``--data``, held out: ``--eval-data``, or the last ``eval_fraction``
    of ``--data``'s tokens (then training never reads them)."""
    train = open_source(data, "--data")
    if eval_data is not None:
        held = open_source(eval_data, "--eval-data")
        if held.byte_level != train.byte_level:
            raise ValueError(
                f"--eval-data {eval_data} and --data {data} must be the same kind (both .bin "
                "token shards or both byte-level), or their tokens mean different things"
            )
        return Corpus(train, held.tokens, f"--eval-data {eval_data}", seq_len, vocab_size, seed)
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(
            f"--eval-fraction {eval_fraction} must lie in (0, 1): the share of --data's tokens "
            "held out for the eval loss"
        )
    n = len(train.tokens)
    cut = n - round(n * eval_fraction)
    split = Source(data, train.files, train.tokens.span(0, cut), train.byte_level)
    held_name = f"the held-out last {eval_fraction:g} of --data {data} (--eval-fraction)"
    return Corpus(split, train.tokens.span(cut, n), held_name, seq_len, vocab_size, seed)
