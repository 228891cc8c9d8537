"""End-to-end checks of examples/train.py: checkpoint/resume across world sizes, MoE Muon.

Every case launches the real script under torchrun on CPU/gloo with a tiny model, so the
path a user runs (fully_shard, muon_dist.Muon, DCP) is what is tested. Launches cost a few
seconds each (importing torch in every rank), hence one module-scoped fixture runs the
checkpoint scenario once and several tests read its outputs.

Why the tolerances differ by world size: resuming on the SAME number of ranks replays the
same floating-point operations, so it must match bit for bit. A different number of ranks
sums gradients in a different order (fp32 rounding, ~1e-7 relative). In bf16, Newton-Schulz
would amplify that into ~1e-3 differences of the update, so these runs use fp32
communication and fp32 Newton-Schulz (``--ns-dtype fp32``), which keep the difference at
fp32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

# Each case launches torchrun (seconds per launch on 2 cores): the slow tier (by its name).

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train.py"
TINY = [
    "--dim", "32",
    "--layers", "2",
    "--heads", "2",
    "--vocab", "64",
    "--seq-len", "32",
    "--batch-size", "6",  # divides 1, 2 and 3 ranks alike; uneven splits work too
    "--steps", "10",
    "--comm-dtype", "fp32",
    "--ns-dtype", "fp32",
    "--no-progress",
    "--no-plot",  # drawing takes seconds a launch: drawn() where a test reads the plot
]  # fmt: skip
CKPT_STEP = 6
LAUNCH_TIMEOUT_S = 300


def launch_env() -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("WORLD_SIZE", None)  # a plain run must take the one-process path
    return env


def drawn(args: Sequence[str]) -> list[str]:
    """``args`` with loss.png drawn."""
    return [a for a in args if a != "--no-plot"]


def launch(nproc: int | None, args: Sequence[str]) -> str:
    """Run train.py on ``nproc`` ranks via torchrun, or as a plain process when None."""
    env = launch_env()
    if nproc is None:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc), str(SCRIPT), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def losses(out: Path, optimizer: str = "muon") -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["optimizer"] == optimizer}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in keys)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted 2-rank run, a 2-rank run stopped at step 6, and three resumes."""
    tmp = tmp_path_factory.mktemp("train_example")
    ckpt = tmp / "ckpt"
    launch(2, [*TINY, "--out", str(tmp / "full"), "--save-final", str(tmp / "full.pt")])
    stop = ["--ckpt-every", str(CKPT_STEP), "--ckpt-dir", str(ckpt), "--stop-after", str(CKPT_STEP)]
    launch(2, [*TINY, "--out", str(tmp / "part"), *stop])
    for name, nproc in (("res2", 2), ("res3", 3), ("res1", None)):
        resume = ["--ckpt-dir", str(ckpt), "--resume", "--save-final", str(tmp / f"{name}.pt")]
        launch(nproc, [*TINY, "--out", str(tmp / name), *resume])
    return {"tmp": tmp, "ckpt": ckpt}


def test_checkpoint_holds_sharded_muon_momentum(resume_runs: dict[str, Path]) -> None:
    """The step-6 checkpoint exists, is complete, and carries non-zero full-size momenta."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = resume_runs["ckpt"] / f"step_{CKPT_STEP:06d}"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["step"] == CKPT_STEP and meta["world_size"] == 2
    flat = resume_runs["tmp"] / "ckpt_flat.pt"
    dcp_to_torch_save(str(folder), str(flat))
    state = torch.load(flat, weights_only=False)
    momenta = {
        name: s["momentum_buffer"]
        for name, s in state["optim"]["state"].items()
        if "momentum_buffer" in s
    }
    assert "layers.0.feed_forward.w1.weight" in momenta
    assert len(momenta) == 2 * 7  # 7 hidden matrices per block
    for name, buf in momenta.items():
        assert buf.shape == state["model"][name].shape, name
        assert buf.norm() > 0, f"{name}: momentum is all zeros"


@pytest.mark.parametrize("name", ["res2", "res3", "res1"])
def test_resume_matches_uninterrupted(resume_runs: dict[str, Path], name: str) -> None:
    """Stop at 6 on 2 ranks, resume on 2/3/1 ranks: same losses and weights as no stop."""
    tmp = resume_runs["tmp"]
    full, part, resumed = losses(tmp / "full"), losses(tmp / "part"), losses(tmp / name)
    assert sorted(full) == list(range(1, 11))
    assert sorted(part) == list(range(1, CKPT_STEP + 1))
    assert sorted(resumed) == list(range(CKPT_STEP + 1, 11))
    for step, loss in part.items():
        assert loss == full[step], f"step {step}: the stopped run is not the same run"

    ref = torch.load(tmp / "full.pt")
    got = torch.load(tmp / f"{name}.pt")
    assert ref.keys() == got.keys()
    muon_keys = [k for k in ref if ref[k].ndim >= 2 and "layers." in k]
    adamw_keys = [k for k in ref if k not in muon_keys]
    if name == "res2":
        # Same world size: the very same arithmetic, so bit-for-bit equality.
        assert all(resumed[s] == full[s] for s in resumed), (resumed, full)
        assert max_rel_diff(got, ref, list(ref)) == 0.0
        return
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-5), f"step {step}"
    # Measured: ~1e-7 for AdamW-updated and ~1.4e-6 for Muon-updated weights.
    assert max_rel_diff(got, ref, adamw_keys) < 1e-5
    assert max_rel_diff(got, ref, muon_keys) < 1e-5


def test_moe_muon_beats_adamw(tmp_path: Path) -> None:
    """MoE with 3-D expert stacks: Muon at its default lr beats AdamW at its default lr."""
    out = tmp_path / "moe"
    stdout = launch(
        2,
        [
            "--moe", "--experts", "4", "--top-k", "2",
            "--dim", "48", "--layers", "2", "--heads", "2", "--vocab", "64",
            "--seq-len", "32", "--batch-size", "16", "--steps", "40",
            "--compare", "muon", "adamw", "--no-progress", "--no-plot", "--out", str(out),
        ],
    )  # fmt: skip
    assert "experts.w1" in stdout and "expert_stack 4x[" in stdout, "routing table"
    muon, adamw = losses(out, "muon"), losses(out, "adamw")
    assert sorted(muon) == sorted(adamw) == list(range(1, 41))
    assert muon[1] == adamw[1], "same init and data for both optimizers"
    tail = range(31, 41)
    muon_final = sum(muon[s] for s in tail) / len(tail)
    adamw_final = sum(adamw[s] for s in tail) / len(tail)
    assert muon_final < adamw_final, (muon_final, adamw_final)


def test_qk_clip_flag_shrinks_query_and_key_heads(resume_runs: dict[str, Path]) -> None:
    """``--qk-clip TAU`` with a tiny TAU clips every step: q/k weights end smaller than in
    the same run without it (the uninterrupted run of ``resume_runs``)."""
    tmp = resume_runs["tmp"]
    final = ["--save-final", str(tmp / "clip.pt")]
    launch(2, [*TINY, "--out", str(tmp / "clip"), *final, "--qk-clip", "0.001"])
    plain, clipped = torch.load(tmp / "full.pt"), torch.load(tmp / "clip.pt")
    for name in plain:
        if ".attention.wq." in name or ".attention.wk." in name:
            assert clipped[name].norm() < 0.9 * plain[name].norm(), name
        elif name.endswith("wv.weight"):
            assert clipped[name].norm().item() == pytest.approx(plain[name].norm().item(), rel=0.2)


def test_expert_parallel_matches_one_process(tmp_path: Path) -> None:
    """``--ep`` splits experts over EP groups (replicated across them): the same training as
    one process holding every expert (expert stacks sharded over two FSDP ranks train in
    test_moe_muon_beats_adamw)."""
    moe = [*TINY, "--moe", "--experts", "4", "--top-k", "2", "--batch-size", "8", "--steps", "4"]
    runs = {"one": (None, "1"), "ep2x2": (4, "2")}
    for name, (nproc, ep) in runs.items():
        out = ["--out", str(tmp_path / name), "--save-final", str(tmp_path / f"{name}.pt")]
        stdout = launch(nproc, [*moe, "--ep", ep, *out])
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
    the plot, and Muon alone in one process."""
    tmp = tmp_path_factory.mktemp("text")
    text = tmp / "readme.txt"
    text.write_bytes((ROOT / "README.md").read_bytes())
    args = [*TINY, "--vocab", "256", "--steps", "4", "--data", str(text), "--eval-every", "2"]
    launch(2, drawn([*args, "--compare", "muon", "normuon", "--out", str(tmp / "two")]))
    launch(None, [*args, "--out", str(tmp / "one")])
    return tmp


def test_compare_runs_the_named_optimizers_on_the_same_data(text_runs: Path) -> None:
    """``--compare muon normuon``: both run from the same init and data, in one plot."""
    out = text_runs / "two"
    muon, normuon = losses(out, "muon"), losses(out, "normuon")
    assert sorted(muon) == sorted(normuon) == [1, 2, 3, 4]
    assert muon[1] == normuon[1], "same init and data for both optimizers"
    assert muon[4] != normuon[4], "NorMuon's rows are normalized: another trajectory"
    assert (out / "loss.png").stat().st_size > 0


def test_overlap_auto_matches_plain_run(resume_runs: dict[str, Path]) -> None:
    """``--overlap auto`` on 2 ranks, which runs steps 4, 5, 8 and 9 with Newton-Schulz
    started during backward, the rest plain, and chooses at the last of the 10 steps: the
    same losses and bit for bit the same weights as the plain run (fp32 exchanges and
    Newton-Schulz). ``overlap="backward"`` from the first step on, bitwise equal to the plain
    step, is tests/distributed/overlap/test_backward_overlap*.py's: the flag reaches Muon
    through the same argument."""
    tmp = resume_runs["tmp"]
    final = ["--save-final", str(tmp / "auto.pt")]
    stdout = launch(2, [*TINY, "--overlap", "auto", "--out", str(tmp / "auto"), *final])
    assert losses(tmp / "auto") == losses(tmp / "full")
    ref, got = torch.load(tmp / "full.pt"), torch.load(tmp / "auto.pt")
    assert ref.keys() == got.keys()
    assert max_rel_diff(got, ref, list(ref)) == 0.0
    assert "step 10: overlap='auto' chose" in stdout, stdout


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
