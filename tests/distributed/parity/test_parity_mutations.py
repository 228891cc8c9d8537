"""The bf16 parity comparison is tight enough to fail on real defects (2 gloo ranks).

Each defect of ``mutations.DEFECTS`` is injected into the sharded step of the ``fsdp``
layout with bf16 communication and Newton–Schulz; the comparison that passes the unchanged
step (``test_distributed_parity.py::...[w2-fsdp-bf16]``) must reject every one of them.
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from mutations import DEFECTS, mutated_parity_worker
from parity_cases import parity_violations


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_bf16_comparison_fails_on_injected_defect(defect: str) -> None:
    results = run_distributed(2, mutated_parity_worker, "fsdp", "bf16", defect)
    assert any(r["hits"] for r in results), f"{defect} never reached the step: its seam moved"
    for rank, result in enumerate(results):
        assert parity_violations(result["errors"], "bf16"), (
            f"rank {rank}: {defect} passed the bf16 comparison: {result['errors']}"
        )
