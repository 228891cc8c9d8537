"""muon_dist.integrations.torchtitan on torchtitan's DeepSeek-V3 debug model, 2 gloo ranks.

Needs ``torchtitan`` (not installed by CI: its dependencies are heavy); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import run_distributed

pytest.importorskip("torchtitan.components.optimizer", reason="needs torchtitan (0.3)")

from torchtitan_cases import resume_worker


def test_torchtitan_container_routes_steps_and_resumes(tmp_path: Path) -> None:
    results = run_distributed(2, resume_worker, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        assert result["mismatched"] == [], (rank, result["mismatched"])
    table = results[0]["table"]
    assert "routed_experts.inner_experts.w1_EFD" in table and "expert_stack 8x[" in table
    assert "moe.shared_experts.w1.weight" in table
