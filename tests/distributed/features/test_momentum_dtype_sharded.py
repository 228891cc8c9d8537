"""``momentum_dtype="bf16"`` under FSDP2 on 2 gloo ranks: every rank's update equals the
single-device reference whose momentum is rounded to bf16 after each advance, under Muon,
NorMuon and Dion2, and DCP checkpoints load back in bf16 (a bf16 one resumes bitwise).

The bound is the exact one (``EXACT``): both sides advance the momentum with the same fp32
add and round it at the same points, so the gathered momenta equal the reference's
bitwise, and the updates differ by fp32 Newton–Schulz's rounding only (the parity tests'
1e-5). The fp32-momentum reference stays at least ``SEEN`` away, so the comparison sees
the bf16 rounding (tests/unit/optimizer/test_momentum_dtype.py says more).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from momentum_dtype_cases import SHAPES, bf16_momentum_worker, dcp_worker

EXACT = 1e-5
SEEN = 10 * EXACT


@pytest.mark.parametrize("rule", ["muon", "normuon", "dion2"])
def test_sharded_bf16_momentum_steps_as_the_bf16_reference(rule: str) -> None:
    for rank, out in enumerate(run_distributed(2, bf16_momentum_worker, rule)):
        assert out["dtypes"] == [torch.bfloat16] * len(SHAPES), f"rank {rank}"
        assert all(out["momenta"]), f"rank {rank}: momenta differ from the reference's"
        assert max(out["bf16"]) <= EXACT, f"rank {rank}: {out['bf16']}"
        assert min(out["fp32"]) >= SEEN, f"rank {rank}: bf16 rounding not seen: {out['fp32']}"


@pytest.mark.parametrize("saved_as", ["bf16", None])
def test_a_dcp_checkpoint_loads_into_bf16_momenta(saved_as: str | None, tmp_path: Path) -> None:
    # The pool's ranks share this machine's file system: the checkpoint goes to tmp_path.
    for rank, out in enumerate(run_distributed(2, dcp_worker, str(tmp_path / "ckpt"), saved_as)):
        assert out["dtypes"] == {torch.bfloat16} and out["group"] == "bf16", f"rank {rank}"
        assert out["loaded"], f"rank {rank}: loaded momenta are not the saved ones in bf16"
        if saved_as == "bf16":
            assert out["diff"] == 0.0, f"rank {rank}: the resumed run differs by {out['diff']}"
