"""examples/checkpoint.py's verifier, in process (no ranks): every damage to a checkpoint's
files is found and named with the file and the reason, a sealed meta.json refuses any change,
and the files split over ranks so that each is checked exactly once. The same checks on 2
ranks, through a resume, are test_checkpoint_faults_slow.py's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from checkpoint_fault_cases import DAMAGE, flip, strip_digests
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import checkpoint as ckpt


def _checkpoint(folder: Path) -> dict[str, dict[str, object]]:
    """A folder with a shard of three chunks, a small index and a sealed meta.json."""
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(os.urandom(3 * ckpt.CHUNK_BYTES - 5))
    (folder / ".metadata").write_bytes(os.urandom(100))
    files = ckpt.digest_files(folder, ["__0_0.distcp", ".metadata"])
    meta = {"step": 4, "elapsed": 1.5, "world_size": 2, "digest": ckpt.FORMAT, "files": files}
    (folder / ckpt.META).write_text(json.dumps(ckpt.seal(meta), indent=1))
    return files


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 KiB chunks: a file of a few chunks is a few kilobytes."""
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 4096)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_every_damage_to_a_file_is_named_with_its_reason(
    tmp_path: Path, name: str, how: str
) -> None:
    folder = tmp_path / "step_000004"
    files = _checkpoint(folder)
    assert ckpt.check_files(folder, files) == []
    DAMAGE[how](folder / name)
    (problem,) = ckpt.check_files(folder, files)
    assert problem.folder == folder and problem.file == name
    reason = {"flipped": "digest mismatch", "deleted": "missing"}.get(how, "when it was saved")
    assert reason in problem.reason
    assert str(problem).startswith(f"{folder / name}: ")


def test_a_flip_is_placed_in_its_chunk(tmp_path: Path) -> None:
    folder = tmp_path / "step_000004"
    files = _checkpoint(folder)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[2 * 4096 + 7] ^= 1  # one bit of the third and last chunk
    shard.write_bytes(bytes(data))
    (problem,) = ckpt.check_files(folder, files)
    assert f"bytes {2 * 4096}-{len(data) - 1} changed" in problem.reason  # the last chunk


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_changed_meta_json_is_refused_with_its_reason(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "step_000004"
    _checkpoint(folder)
    meta, problem = ckpt.read_meta(folder)
    assert problem is None and meta is not None and meta["step"] == 4
    DAMAGE[how](folder / ckpt.META)
    meta, problem = ckpt.read_meta(folder)
    assert meta is None and problem is not None
    assert problem.file == ckpt.META and problem.folder == folder
    assert problem.reason.split(" ")[0] in {"missing", "unreadable", "its"}, problem.reason


def test_a_meta_json_without_digests_is_read_as_before(tmp_path: Path) -> None:
    """Checkpoints saved before digests existed still load (unverified, said by the loader)."""
    folder = tmp_path / "step_000004"
    _checkpoint(folder)
    strip_digests(folder / ckpt.META)
    meta, problem = ckpt.read_meta(folder)
    assert problem is None and meta is not None and "files" not in meta
    flip(folder / ckpt.META)  # a changed digit there is not seen: nothing to check it against
    assert ckpt.read_meta(folder)[1] is None


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_file_is_checked_by_exactly_one_rank(world_size: int) -> None:
    sizes = [7, 100, 3, 3, 50, 0, 64, 9]
    files = {f"__{i}_0.distcp": {"size": s, "crc32": []} for i, s in enumerate(sizes)}
    split = ckpt.shares(files, world_size)
    assert len(split) == world_size
    assert sorted(name for share in split for name in share) == sorted(files)
    loads = [sum(int(files[n]["size"]) for n in share) for share in split]  # type: ignore[call-overload]
    assert max(loads) - min(loads) <= max(sizes), "longest first onto the least loaded rank"


def test_complete_checkpoints_are_newest_first_and_skip_partial_saves(tmp_path: Path) -> None:
    for name in ("step_000002", "step_000010", "step_000004", "step_000012.partial", "other"):
        (tmp_path / name).mkdir()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == [
        "step_000010",
        "step_000004",
        "step_000002",
    ]
