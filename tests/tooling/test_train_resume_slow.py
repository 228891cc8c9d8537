"""End-to-end checks of examples/train.py: checkpoint/resume across world sizes, and the flags
checked against the same uninterrupted run (``--qk-clip``, ``--overlap auto``).

Every case runs the real script on CPU/gloo with a tiny model (train_launch.py), so the
path a user runs (fully_shard, muon_dist.Muon, DCP) is what is tested: the uninterrupted
reference under torchrun, the other runs in ranks forked with torch imported
(``launch_forked``: the same script and environment, without the seconds each rank spends
importing torch again). The 2-rank resume and ``--overlap auto`` must end bit for bit where
the reference ends, so the forked runs are held to the torchrun one. One module-scoped
fixture runs the checkpoint scenario once and several tests read its outputs.
The MoE and text-data runs are test_train_moe_text_slow.py's: a file of their own, so that
pytest-xdist's two workers run the two halves of the example's launches side by side.

Why the tolerances differ by world size: resuming on the SAME number of ranks replays the
same floating-point operations, so it must match bit for bit. A different number of ranks
sums gradients in a different order (fp32 rounding, ~1e-7 relative). In bf16, Newton-Schulz
would amplify that into ~1e-3 differences of the update, so these runs use fp32
communication and fp32 Newton-Schulz (``--ns-dtype fp32``), which keep the difference at
fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_launch import TINY, launch, launch_forked, losses, max_rel_diff

# Each case runs the script (a torchrun launch takes seconds on 2 cores): the slow tier.

CKPT_STEP = 6


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted 2-rank run under torchrun, and forked: a 2-rank run stopped at step
    6 and three resumes."""
    tmp = tmp_path_factory.mktemp("train_example")
    ckpt = tmp / "ckpt"
    launch(2, [*TINY, "--out", str(tmp / "full"), "--save-final", str(tmp / "full.pt")])
    stop = ["--ckpt-every", str(CKPT_STEP), "--ckpt-dir", str(ckpt), "--stop-after", str(CKPT_STEP)]
    launch_forked(2, [*TINY, "--out", str(tmp / "part"), *stop], tmp / "logs" / "part")
    for name, nproc in (("res2", 2), ("res3", 3), ("res1", None)):
        resume = ["--ckpt-dir", str(ckpt), "--resume", "--save-final", str(tmp / f"{name}.pt")]
        launch_forked(nproc, [*TINY, "--out", str(tmp / name), *resume], tmp / "logs" / name)
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


def test_qk_clip_flag_shrinks_query_and_key_heads(resume_runs: dict[str, Path]) -> None:
    """``--qk-clip TAU`` with a tiny TAU clips every step: q/k weights end smaller than in
    the same run without it (the uninterrupted run of ``resume_runs``)."""
    tmp = resume_runs["tmp"]
    final = ["--save-final", str(tmp / "clip.pt")]
    clip = [*TINY, "--out", str(tmp / "clip"), *final, "--qk-clip", "0.001"]
    launch_forked(2, clip, tmp / "logs" / "clip")
    plain, clipped = torch.load(tmp / "full.pt"), torch.load(tmp / "clip.pt")
    for name in plain:
        if ".attention.wq." in name or ".attention.wk." in name:
            assert clipped[name].norm() < 0.9 * plain[name].norm(), name
        elif name.endswith("wv.weight"):
            assert clipped[name].norm().item() == pytest.approx(plain[name].norm().item(), rel=0.2)


def test_overlap_auto_matches_plain_run(resume_runs: dict[str, Path]) -> None:
    """``--overlap auto`` on 2 ranks, which runs steps 4, 5, 8 and 9 with Newton-Schulz
    started during backward, the rest plain, and chooses at the last of the 10 steps: the
    same losses and bit for bit the same weights as the plain run (fp32 exchanges and
    Newton-Schulz). ``overlap="backward"`` from the first step on, bitwise equal to the plain
    step, is tests/distributed/overlap/test_backward_overlap*.py's: the flag reaches Muon
    through the same argument."""
    tmp = resume_runs["tmp"]
    final = ["--save-final", str(tmp / "auto.pt")]
    auto = [*TINY, "--overlap", "auto", "--out", str(tmp / "auto"), *final]
    stdout = launch_forked(2, auto, tmp / "logs" / "auto")
    assert losses(tmp / "auto") == losses(tmp / "full")
    ref, got = torch.load(tmp / "full.pt"), torch.load(tmp / "auto.pt")
    assert ref.keys() == got.keys()
    assert max_rel_diff(got, ref, list(ref)) == 0.0
    assert "step 10: overlap='auto' chose" in stdout, stdout
