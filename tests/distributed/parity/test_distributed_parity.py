"""The sharded step equals single-device Muon on every supported layout (gloo, CPU).

One test per (world size, layout, precision): fp32 communication and Newton–Schulz compared
exactly, bf16 within bf16 rounding (parity_cases.BF16_UPDATE). Each world size's cases run in
one process group that stays up for the session (dist_harness).
"""

from __future__ import annotations

import pytest
from _pytest.mark import ParameterSet
from dist_harness import run_distributed
from parity_cases import PRECISIONS, case_names, parity_violations, parity_worker

# The quick tier keeps one sharded layout on two ranks; test_distributed_parity_slow.py runs
# the rest.
QUICK = {(2, "fsdp")}


def cases(quick: bool) -> list[ParameterSet]:
    """The (world size, layout, precision) cases of the quick tier, or of the slow one."""
    return [
        pytest.param(world_size, name, precision, id=f"w{world_size}-{name}-{precision}")
        for world_size in (1, 2, 3, 4)
        for name in case_names(world_size)
        for precision in PRECISIONS
        if ((world_size, name) in QUICK) == quick
    ]


@pytest.mark.parametrize(("world_size", "name", "precision"), cases(quick=True))
def test_sharded_step_matches_single_device(world_size: int, name: str, precision: str) -> None:
    """fp32 throughout: exact; bf16 or mixed: within bf16 rounding (parity_cases.BF16_UPDATE)."""
    comm, ns = PRECISIONS[precision]
    results = run_distributed(world_size, parity_worker, name, comm, ns)
    for rank, err in enumerate(results):
        assert not parity_violations(err, precision), f"rank {rank}: {err}"
