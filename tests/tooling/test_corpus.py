"""The example's data: ``.bin`` token shards and byte-level files (examples/corpus.py),
batches as pure functions of (seed, step, row), and scripts/make_corpus.py.

Tiny files under tmp_path; no process group. The property that makes resuming on another
number of ranks exact is checked directly: the rows ranks build on their own, at any world
size and after any history, are the rows of the one-rank batch.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from repo_paths import ROOT, example_module

corpus = example_module("corpus")
data = example_module("data")

SEQ = 16
L = SEQ + 1  # tokens in one window


def counting_shard(path: Path, start: int, count: int) -> np.ndarray:
    """A shard whose token at stream position p is p: windows show where they came from."""
    tokens = np.arange(start, start + count)
    corpus.write_bin(path, tokens)
    return tokens


def rows_at(world: int, rank: int, batch: int) -> slice:
    return data.rank_slice(batch, rank, world)


def test_bin_roundtrip_matches_hand_written_header(tmp_path: Path) -> None:
    """``write_bin`` writes exactly the llm.c layout, and ``read_bin`` maps it read-only."""
    tokens = [0, 1, 50256, 65535, 7]
    header = struct.pack("<3i", 20240520, 1, len(tokens)) + bytes(4 * 253)
    expected = header + struct.pack(f"<{len(tokens)}H", *tokens)
    path = tmp_path / "a.bin"
    corpus.write_bin(path, np.array(tokens))
    assert path.read_bytes() == expected
    mapped = corpus.read_bin(path, "--data")
    assert isinstance(mapped, np.memmap)
    assert not mapped.flags.writeable
    assert mapped.tolist() == tokens


@pytest.mark.parametrize(
    ("header", "tokens", "message"),
    [
        ((20240521, 1, 2), 2, "header magic 20240521, expected 20240520"),
        ((20240520, 2, 2), 2, "header version 2; only version 1"),
        ((20240520, 1, 5), 2, "the header counts 5 tokens .* but the file has 1028 bytes"),
    ],
)
def test_bin_header_is_checked(
    tmp_path: Path, header: tuple[int, int, int], tokens: int, message: str
) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<3i", *header) + bytes(4 * 253) + bytes(2 * tokens))
    with pytest.raises(ValueError, match=f"--data {re.escape(str(path))}: {message}"):
        corpus.read_bin(path, "--data")


def test_bin_shorter_than_its_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.bin"
    path.write_bytes(b"plain text saved as .bin")
    with pytest.raises(ValueError, match=r"shorter than the 1024-byte header.*rename"):
        corpus.open_source(str(path), "--data")


def test_glob_concatenates_shards_in_sorted_order(tmp_path: Path) -> None:
    """Files made out of order are read in sorted path order, windows cross file boundaries,
    and a shard with no tokens adds none."""
    counting_shard(tmp_path / "part_2.bin", 30, 5)
    counting_shard(tmp_path / "part_0.bin", 0, 12)
    counting_shard(tmp_path / "part_1a.bin", 12, 0)
    counting_shard(tmp_path / "part_1b.bin", 12, 18)
    source = corpus.open_source(str(tmp_path / "part_*.bin"), "--data")
    assert [f.name for f in source.files] == [
        "part_0.bin",
        "part_1a.bin",
        "part_1b.bin",
        "part_2.bin",
    ]
    assert not source.byte_level
    assert len(source.tokens) == 35
    for start in range(35):
        for length in range(35 - start + 1):
            assert source.tokens.read(start, length).tolist() == list(range(start, start + length))
    with pytest.raises(ValueError, match="outside a stream of 35 tokens"):
        source.tokens.read(30, 6)
    inner = source.tokens.span(10, 20)
    assert inner.read(0, 10).tolist() == list(range(10, 20))


def test_pattern_errors_name_the_flag_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--data '.*/\*\.bin' matches no file"):
        corpus.open_source(str(tmp_path / "*.bin"), "--data")
    with pytest.raises(ValueError, match="is a directory; name its files with a glob"):
        corpus.open_source(str(tmp_path), "--eval-data")
    counting_shard(tmp_path / "a.bin", 0, 40)
    (tmp_path / "b.txt").write_text("some text")
    with pytest.raises(ValueError, match=r"matches both \.bin token shards .* narrow the glob"):
        corpus.open_source(str(tmp_path / "*"), "--data")


def test_text_is_read_byte_level(tmp_path: Path) -> None:
    """Any file that is not .bin: one token per byte, UTF-8 multi-byte characters included;
    several files in sorted order."""
    (tmp_path / "b.md").write_text("naïve → ok\n", encoding="utf-8")
    (tmp_path / "a.txt").write_bytes(bytes(range(256)))
    source = corpus.open_source(str(tmp_path / "*"), "--data")
    assert source.byte_level
    expected = list(range(256)) + list("naïve → ok\n".encode())
    assert source.tokens.read(0, len(source.tokens)).tolist() == expected


def test_vocab_and_length_errors_name_their_flags(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="--vocab 64 is smaller than the 256 byte values"):
        corpus.open_corpus(str(text), None, 0.1, SEQ, 64, 0)
    # 100 tokens, 10 held out: a window of 17 fits in training but not in the held-out part.
    with pytest.raises(ValueError, match=r"held-out last 0\.1 .* fewer than the --seq-len 16 \+ 1"):
        corpus.open_corpus(str(text), None, 0.1, SEQ, 256, 0)
    with pytest.raises(ValueError, match=r"--data .* has 50 tokens, fewer than the --seq-len 60"):
        corpus.open_corpus(str(text), None, 0.5, 60, 256, 0)
    with pytest.raises(ValueError, match=r"--eval-fraction 1\.0 must lie in"):
        corpus.open_corpus(str(text), None, 1.0, SEQ, 256, 0)
    shard = tmp_path / "big.bin"
    corpus.write_bin(shard, np.full(200, 300))
    big = corpus.open_corpus(str(shard), None, 0.5, SEQ, 256, 0)
    with pytest.raises(
        ValueError, match=r"token id 300 in training step 3 .* outside --vocab 256.*50304"
    ):
        big.batch(3, 4, slice(0, 4))
    with pytest.raises(ValueError, match="must be the same kind"):
        corpus.open_corpus(str(shard), str(text), 0.05, SEQ, 512, 0)


@pytest.fixture
def counted(tmp_path: Path) -> Any:
    """A two-shard counting corpus of 2000 tokens, the last 10% held out."""
    counting_shard(tmp_path / "s0.bin", 0, 1200)
    counting_shard(tmp_path / "s1.bin", 1200, 800)
    return corpus.open_corpus(str(tmp_path / "s*.bin"), None, 0.1, SEQ, 65536, 5)


def test_batches_are_windows_of_the_training_split(counted: Any) -> None:
    """Every row is a contiguous window of the first 90%: held-out tokens never train."""
    for step in range(1, 30):
        batch = counted.batch(step, 8, slice(0, 8))
        assert batch.shape == (8, L) and batch.dtype == np.int64
        assert (np.diff(batch, axis=1) == 1).all()
        assert batch.min() >= 0 and batch.max() < 1800


def test_batches_are_a_function_of_seed_and_step(tmp_path: Path, counted: Any) -> None:
    again = corpus.open_corpus(str(tmp_path / "s*.bin"), None, 0.1, SEQ, 65536, 5)
    other_seed = corpus.open_corpus(str(tmp_path / "s*.bin"), None, 0.1, SEQ, 65536, 6)
    full = slice(0, 8)
    for step in (1, 2, 1000):
        batch = counted.batch(step, 8, full)
        assert np.array_equal(batch, again.batch(step, 8, full))
        assert not np.array_equal(batch, other_seed.batch(step, 8, full))
    steps = [counted.batch(s, 8, full)[:, 0].tolist() for s in (1, 2, 3)]
    assert steps[0] != steps[1] != steps[2]


@pytest.mark.parametrize("batch", [6, 7])
def test_rows_do_not_depend_on_world_size(counted: Any, batch: int) -> None:
    """The ranks' own rows, stacked, are the one-rank batch at W = 1, 2, 3 (uneven splits
    too), for training and eval batches and for the Markov chain."""
    chain = data.MarkovChain(32, seed=3)
    for step in (1, 9):
        ref = counted.batch(step, batch, slice(0, batch))
        ref_eval = counted.eval_batch(step % 2, batch, slice(0, batch), 2)
        ref_chain = chain.batch(step, batch, SEQ, slice(0, batch))
        for world in (1, 2, 3):
            ranks = [rows_at(world, r, batch) for r in range(world)]
            got = np.concatenate([counted.batch(step, batch, s) for s in ranks])
            got_eval = np.concatenate([counted.eval_batch(step % 2, batch, s, 2) for s in ranks])
            got_chain = torch.cat([chain.batch(step, batch, SEQ, s) for s in ranks])
            assert np.array_equal(got, ref), (step, world)
            assert np.array_equal(got_eval, ref_eval), (step, world)
            assert torch.equal(got_chain, ref_chain), (step, world)


def test_resume_on_another_rank_count_reads_the_same_batches(tmp_path: Path) -> None:
    """Steps 1-4 on 2 ranks, then a fresh process (new corpus object) on 3 ranks from step
    5: each step's batch is the uninterrupted one-rank run's; history does not enter."""
    counting_shard(tmp_path / "s.bin", 0, 3000)
    pattern = str(tmp_path / "s.bin")
    straight = corpus.open_corpus(pattern, None, 0.1, SEQ, 65536, 1)
    expected = [straight.batch(step, 6, slice(0, 6)) for step in range(1, 9)]
    first = corpus.open_corpus(pattern, None, 0.1, SEQ, 65536, 1)
    resumed = corpus.open_corpus(pattern, None, 0.1, SEQ, 65536, 1)
    for step in range(1, 9):
        source, world = (first, 2) if step <= 4 else (resumed, 3)
        got = np.concatenate([source.batch(step, 6, rows_at(world, r, 6)) for r in range(world)])
        assert np.array_equal(got, expected[step - 1]), step


def test_eval_batches_are_fixed_and_span_the_held_out_split(tmp_path: Path) -> None:
    """Eval windows do not depend on the seed, start at both ends of the held-out tokens
    and are evenly spaced between; --eval-data replaces the split."""
    counting_shard(tmp_path / "train.bin", 0, 1000)
    counting_shard(tmp_path / "val.bin", 5000, 300)
    a = corpus.open_corpus(
        str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), 0.5, SEQ, 65536, 0
    )
    b = corpus.open_corpus(
        str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), 0.5, SEQ, 65536, 9
    )
    windows = np.concatenate([a.eval_batch(i, 4, slice(0, 4), 3) for i in range(3)])
    assert np.array_equal(
        windows, np.concatenate([b.eval_batch(i, 4, slice(0, 4), 3) for i in range(3)])
    )
    starts = windows[:, 0] - 5000
    assert starts[0] == 0 and starts[-1] == 300 - L
    assert np.abs(np.diff(starts) - (300 - L) / 11).max() < 1
    assert len(a.source.tokens) == 1000  # --eval-data: all of --data trains
    with pytest.raises(ValueError, match="evaluation batch 3 outside"):
        a.eval_batch(3, 4, slice(0, 4), 3)


def run_make_corpus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_corpus.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_make_corpus_writes_readable_deterministic_shards(tmp_path: Path) -> None:
    """A tiny source tree: text files become 0-separated byte documents in train and val
    shards the reader accepts; caches, nested site-packages, editable finders, other
    extensions, empty files and files with 0 bytes stay out; the same input gives the same
    bytes and checksum, and the cap holds."""
    src = tmp_path / "src"
    docs = {}
    for i in range(24):
        name = f"pkg{i % 3}/mod_{i}." + ("py", "md", "rst", "txt")[i % 4]
        docs[name] = f"document {i}: {'é' * i}\n".encode() * (i + 1)
    left_out = {
        "pkg0/__pycache__/cached.py": b"cached",
        "pkg0/site-packages/nested.py": b"nested",
        "__editable___x_finder.py": b"/some/checkout",
        "pkg1/data.json": b"{}",
        "pkg1/empty.py": b"",
        "pkg2/binary.txt": b"a\0b",
    }
    for name, text in {**docs, **left_out}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(text)

    outputs = []
    for out in ("one", "two"):
        proc = run_make_corpus(
            "--source",
            str(src),
            "--out",
            str(tmp_path / out),
            "--val-fraction",
            "0.3",
            "--shard-tokens",
            "500",
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    checksums = [re.search(r"corpus sha256 .*: ([0-9a-f]{64})", o).group(1) for o in outputs]
    assert checksums[0] == checksums[1]
    counts = re.search(r"documents: (\d+) train, (\d+) validation; left out: (.*)", outputs[0])
    assert counts is not None
    assert int(counts.group(1)) + int(counts.group(2)) == len(docs)
    assert counts.group(3) == "1 empty, 1 with a 0 byte"

    found = {}
    for split in ("train", "val"):
        shards = sorted((tmp_path / "one").glob(f"{split}_*.bin"))
        assert shards, split
        twins = [tmp_path / "two" / s.name for s in shards]
        assert [s.read_bytes() for s in shards] == [t.read_bytes() for t in twins]
        source = corpus.open_source(str(tmp_path / "one" / f"{split}_*.bin"), "--data")
        stream = bytes(source.tokens.read(0, len(source.tokens)).astype(np.uint8))
        assert stream[:1] == b"\0"
        found[split] = stream[1:].split(b"\0")
    assert found["train"] and found["val"]
    assert sorted(found["train"] + found["val"]) == sorted(docs.values())

    kept = {path: path.read_bytes() for path in (tmp_path / "one").iterdir()}
    stale = run_make_corpus("--source", str(src), "--out", str(tmp_path / "one"))
    assert stale.returncode != 0 and "already exists and is not an empty folder" in stale.stderr
    assert {path: path.read_bytes() for path in (tmp_path / "one").iterdir()} == kept

    capped = run_make_corpus(
        "--source",
        str(src),
        "--out",
        str(tmp_path / "cap"),
        "--val-fraction",
        "0.3",
        "--max-tokens",
        "2000",
    )
    assert capped.returncode == 0, capped.stderr
    sizes = [p.stat().st_size - 1024 for p in (tmp_path / "cap").glob("*.bin")]
    assert 0 < sum(sizes) // 2 <= 2000 and "stopped at the --max-tokens cap" in capped.stdout


def whole_row_walk(chain: Any, step: int, batch: int, seq: int, rows: slice) -> torch.Tensor:
    """The chain's batch by ``torch.searchsorted`` over each whole CDF row, as data.py
    walked it before the blocked search: the tokens every earlier run trained on."""
    g = torch.Generator().manual_seed(data._mix(chain.seed, step))
    u = torch.rand(seq + 1, batch, 1, generator=g, dtype=torch.float64)[:, rows]
    cdf = chain.transition.cumsum(dim=1)
    last = chain.vocab_size - 1
    tokens = torch.empty(seq + 1, u.size(1), dtype=torch.long)
    tokens[0] = torch.searchsorted(chain.stationary.cumsum(dim=0), u[0, :, 0]).clamp_max(last)
    for t in range(1, seq + 1):
        tokens[t] = torch.searchsorted(cdf[tokens[t - 1]], u[t]).squeeze(1).clamp_max(last)
    return tokens.T.contiguous()


@pytest.mark.parametrize("vocab", [2, 37, 256, 1000])
def test_markov_batches_are_the_whole_row_search_ones(vocab: int) -> None:
    """The blocked search draws exactly the tokens of the whole-row search, for a vocabulary
    that is a square, one that is not (its last block padded) and the smallest."""
    chain = data.MarkovChain(vocab, seed=5)
    for step, rows in ((1, slice(0, 6)), (7, slice(2, 5))):
        got = chain.batch(step, 6, 40, rows)
        assert got.dtype == torch.long and got.shape == (rows.stop - rows.start, 41)
        assert torch.equal(got, whole_row_walk(chain, step, 6, 40, rows)), (vocab, step)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--val-fraction", "0.001"], "no document went to the val split"),
        (["--shard-tokens", "0"], "--shard-tokens 0 must be >= 1"),
        (["--max-tokens", "-5"], "--max-tokens -5 must be >= 1"),
        (["--source", "missing"], "is not a folder"),
    ],
)
def test_make_corpus_refuses_before_it_writes_and_leaves_no_folder(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.py").write_text("a single document\n")
    out = tmp_path / "deep" / "corpus"
    proc = run_make_corpus("--source", str(src), *flags, "--out", str(out))
    assert proc.returncode != 0 and named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "a folder was left behind"
