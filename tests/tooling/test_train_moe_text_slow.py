"""End-to-end checks of examples/train.py: MoE Muon (against AdamW, and expert parallel
against one process), and byte-level text data (``--data``, ``--compare``).

Every case runs the real script on CPU/gloo with a tiny model (train_launch.py: fp32
communication and Newton-Schulz, so one process and several ranks differ by fp32 rounding
only): the two-rank text run under torchrun, the others in ranks forked with torch imported
(``launch_forked``: the same script and environment, without importing torch again per
rank). The checkpoint/resume runs are test_train_resume_slow.py's:
a file of their own, so that pytest-xdist's two workers run the two halves of the example's
launches side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT
from train_launch import TINY, drawn, launch, launch_forked, losses, max_rel_diff

# Each case runs the script (a torchrun launch takes seconds on 2 cores): the slow tier.


def test_moe_muon_beats_adamw(tmp_path: Path) -> None:
    """MoE with 3-D expert stacks: Muon at its default lr beats AdamW at its default lr."""
    out = tmp_path / "moe"
    stdout = launch_forked(
        2,
        [
            "--moe", "--experts", "4", "--top-k", "2",
            "--dim", "48", "--layers", "2", "--heads", "2", "--vocab", "64",
            "--seq-len", "32", "--batch-size", "16", "--steps", "40",
            "--compare", "muon", "adamw", "--no-progress", "--no-plot", "--out", str(out),
        ],
        tmp_path / "logs",
    )  # fmt: skip
    assert "experts.w1" in stdout and "expert_stack 4x[" in stdout, "routing table"
    muon, adamw = losses(out, "muon"), losses(out, "adamw")
    assert sorted(muon) == sorted(adamw) == list(range(1, 41))
    assert muon[1] == adamw[1], "same init and data for both optimizers"
    tail = range(31, 41)
    muon_final = sum(muon[s] for s in tail) / len(tail)
    adamw_final = sum(adamw[s] for s in tail) / len(tail)
    assert muon_final < adamw_final, (muon_final, adamw_final)


def test_expert_parallel_matches_one_process(tmp_path: Path) -> None:
    """``--ep`` splits experts over EP groups (replicated across them): the same training as
    one process holding every expert (expert stacks sharded over two FSDP ranks train in
    test_moe_muon_beats_adamw)."""
    moe = [*TINY, "--moe", "--experts", "4", "--top-k", "2", "--batch-size", "8", "--steps", "4"]
    runs = {"one": (None, "1"), "ep2x2": (4, "2")}
    for name, (nproc, ep) in runs.items():
        out = ["--out", str(tmp_path / name), "--save-final", str(tmp_path / f"{name}.pt")]
        stdout = launch_forked(nproc, [*moe, "--ep", ep, *out], tmp_path / "logs" / name)
        assert "expert_stack 4x[" in stdout
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "ep2x2")
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    ref_w, got_w = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "ep2x2.pt")
    assert max_rel_diff(got_w, ref_w, list(ref_w)) < 1e-5


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--data`` on byte-level text, 4 steps: ``--compare muon normuon`` on two ranks with
    the plot (torchrun), and Muon alone in one process (forked)."""
    tmp = tmp_path_factory.mktemp("text")
    text = tmp / "readme.txt"
    text.write_bytes((ROOT / "README.md").read_bytes())
    args = [*TINY, "--vocab", "256", "--steps", "4", "--data", str(text), "--eval-every", "2"]
    launch(2, drawn([*args, "--compare", "muon", "normuon", "--out", str(tmp / "two")]))
    launch_forked(None, [*args, "--out", str(tmp / "one")], tmp / "logs")
    return tmp


def test_compare_runs_the_named_optimizers_on_the_same_data(text_runs: Path) -> None:
    """``--compare muon normuon``: both run from the same init and data, in one plot."""
    out = text_runs / "two"
    muon, normuon = losses(out, "muon"), losses(out, "normuon")
    assert sorted(muon) == sorted(normuon) == [1, 2, 3, 4]
    assert muon[1] == normuon[1], "same init and data for both optimizers"
    assert muon[4] != normuon[4], "NorMuon's rows are normalized: another trajectory"
    assert (out / "loss.png").stat().st_size > 0


def test_data_flag_trains_and_evaluates_alike_on_one_and_two_ranks(text_runs: Path) -> None:
    """``--data`` on byte-level text, the last 5% held out: an eval loss every 2 steps in
    metrics.jsonl and the plot; one process and two ranks read the same rows of every batch
    (fp32 arithmetic: the same losses, up to the order of sums)."""
    runs = {}
    for name in ("one", "two"):
        rows = [json.loads(line) for line in (text_runs / name / "metrics.jsonl").open()]
        rows = [r for r in rows if r["optimizer"] == "muon"]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
        runs[name] = rows
    assert (text_runs / "two" / "loss.png").stat().st_size > 0
    for one, two in zip(runs["one"], runs["two"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
        if "eval_loss" in one:
            assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5), one["step"]
