"""NorMuon and Dion2: the sharded step equals the single-device reference on every layout
(gloo, CPU), and a checkpoint saved on 2 ranks resumes exactly on 3.

Two suites per rule: the parity suite's layouts (FSDP2 with uneven and empty shards, a
transactional step, Shard(1), plain replicas, HSDP both modes, TP+FSDP, expert parallel
with and without FSDP) with every Muon group under the rule, and the matrices a parameter
is cut into (heads, row blocks, parts cut on the owner, ``[in, out]`` storage, experts,
fused experts, and for Dion2 an exact tie for the last selected slot), weights and
momenta. Dion2's references are plain loops over each matrix's slices: its weights and
momenta agree to fp32 rounding only if every rank selected the slices the single-device
reference did (a different slice moves a weight by the learning rate and leaves a momentum
undecayed), so the runs on 1 to 4 ranks also show the selection independent of the layout.
fp32 communication and Newton–Schulz throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _pytest.mark import ParameterSet
from dist_harness import run_distributed
from normuon_cases import layouts, normuon_worker
from parity_cases import case_names, parity_worker

RULES = ("normuon", "dion2")
# The quick tier keeps these; test_rule_parity_slow.py runs the rest.
QUICK = {("normuon", 2, "fsdp"), ("dion2", 2, "fsdp"), ("dion2", 3, "fsdp")}


def cases(names_of: Callable[[int], list[str]], quick: bool) -> list[ParameterSet]:
    """The (rule, world size, case) triples of the quick tier, or of the slow one."""
    return [
        pytest.param(rule, w, n, id=f"{rule}-w{w}-{n}")
        for rule in RULES
        for w in (1, 2, 3, 4)
        for n in names_of(w)
        if ((rule, w, n) in QUICK) == quick
    ]


@pytest.mark.parametrize(("rule", "world_size", "name"), cases(case_names, quick=True))
def test_parity_layouts(rule: str, world_size: int, name: str) -> None:
    results = run_distributed(world_size, parity_worker, name, "float32", "float32", "cpu", rule)
    for rank, err in enumerate(results):
        assert err["update"] <= 1e-5, f"rank {rank}: {err}"
        assert err["bf16_param"] <= 3e-2, f"rank {rank}: {err}"


@pytest.mark.parametrize(("rule", "world_size", "layout"), cases(layouts, quick=True))
def test_views_and_parts(rule: str, world_size: int, layout: str) -> None:
    results = run_distributed(world_size, normuon_worker, layout, "", rule)
    for rank, err in enumerate(results):
        assert err <= 1e-5, f"rank {rank} layout {layout}: {err}"


@pytest.mark.parametrize("rule", RULES)
def test_checkpoint_saved_on_two_ranks_resumes_exactly_on_three(rule: str, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(2, normuon_worker, "save", path, rule)
    resumed = run_distributed(3, normuon_worker, "resume", path, rule)
    for states in (uninterrupted, resumed):
        for other in states[1:]:  # full values (and NorMuon's replicated moments) agree
            for a, b in zip(states[0], other, strict=True):
                assert torch.equal(a, b)
    for a, b in zip(uninterrupted[0], resumed[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
