"""Stacks that are the exchange's own buffers (plan/in_place.py) change no bit of a step:
each parity layout trained with them and all packed comes out bitwise equal, on 2 to 4 gloo
ranks (cases in in_place_cases.py)."""

from __future__ import annotations

import pytest
from _pytest.mark import ParameterSet
from dist_harness import run_distributed
from in_place_cases import in_place_worker
from parity_cases import case_names

# In place in both directions on every rank count: 1-D FSDP2, with uneven shards and, on 4
# ranks, a rank without rows of the 3-row matrix (the other layouts are checked for which
# buckets go in place in tests/unit/plan/test_in_place.py).
IN_PLACE = ("fsdp", "fsdp_skip_mode")


def cases(quick: bool) -> list[ParameterSet]:
    """(world size, layout, precision, rule): the quick tier's 1-D FSDP2 in fp32 and bf16,
    or the slow tier's other layouts.

    Which buckets go in place is decided per layout and checked on every layout and rank
    count in tests/unit/plan/test_in_place.py; here each layout trains once, in fp32, on 2
    ranks or, where 4 ranks lay it out differently (replica groups, TP and EP meshes), on 4,
    plus the mixed precision whose in-place scatter casts the result stack first.
    """
    # 3 ranks shard unevenly; 4 leave a rank without rows of the 3-row matrix.
    quick_cases = [(2, "fsdp", "bf16", "muon"), (3, "fsdp", "fp32", "muon")]
    quick_cases += [(4, "fsdp", "fp32", "muon"), (4, "fsdp", "bf16", "muon")]
    four = ("hsdp_split", "hsdp_redundant", "tp_fsdp", "ep_fsdp")
    slow = [(2, name, "fp32", "muon") for name in case_names(2) if name not in (*four, "fsdp")]
    slow += [(4, name, "fp32", "muon") for name in four]
    slow += [(2, "fsdp", "mixed", "muon"), (4, "fsdp", "fp32", "normuon")]
    # Dion2 (packed: its selected exchange) on 3 and 4 ranks, where buckets this small leave
    # a rank a bucket it holds nothing of (its slice norms once failed there).
    slow += [(w, "fsdp", "fp32", "dion2") for w in (3, 4)]
    return [
        pytest.param(*case, id="-".join(str(part) for part in case))
        for case in (quick_cases if quick else slow)
    ]


@pytest.mark.parametrize(("world_size", "name", "precision", "rule"), cases(quick=True))
def test_in_place_equals_packed(world_size: int, name: str, precision: str, rule: str) -> None:
    outs = run_distributed(world_size, in_place_worker, name, precision, rule)
    for rank, out in enumerate(outs):
        assert out["equal"], f"rank {rank}: parameters or state differ: {out}"
    if name in IN_PLACE and rule == "muon":
        assert sum(out["gathers"] for out in outs) > 0, outs
        assert sum(out["scatters"] for out in outs) > 0, outs
