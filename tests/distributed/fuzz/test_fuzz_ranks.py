"""Distributed fuzz: random per-rank perturbations of options, settings, parameter order and
names end either in identical results on every rank or in an error on every rank.

Hypothesis draws what each of 2 or 3 gloo ranks changes (at construction, or between two steps);
the ranks run it through the session's pool (tests/support/dist_harness.py), each reporting its
result or its error. Where what the ranks were given differs, every rank must raise; where
it is the same, they must all succeed alike or all raise. A hang fails on the pool's timeout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist_harness import run_distributed
from fuzz_rank_cases import NAMES, fuzz_worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

OPTIONS = {
    "lr": st.sampled_from([0.02, 0.01, math.nan, -1.0, "0.1"]),
    "momentum": st.sampled_from([0.95, 0.9, 1.0]),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "nesterov": st.booleans(),
    "ns_steps": st.sampled_from([5, 3]),
}
SETTINGS = {
    "bucket_bytes": st.sampled_from([128 * 2**20, 64, 1.5]),
    "nonfinite": st.sampled_from(["raise", "skip_step", "bogus"]),
    "comm_dtype": st.sampled_from([torch.bfloat16, torch.float32]),
    "max_inflight": st.sampled_from([3, 1]),
}
RANK = st.fixed_dictionaries(
    {},
    optional={
        "construct": st.fixed_dictionaries({}, optional={**OPTIONS, **SETTINGS}),
        "later": st.fixed_dictionaries({}, optional=OPTIONS),
        "reverse": st.booleans(),
        "rename": st.fixed_dictionaries({}, optional={NAMES[0]: st.just("attn.wq2")}),
    },
)


DEFAULTS = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "nesterov": True,
    "ns_steps": 5,
    "bucket_bytes": 128 * 2**20,
    "nonfinite": "raise",
    "comm_dtype": torch.bfloat16,
    "max_inflight": 3,
}


def _effective(spec: dict[str, Any]) -> str:
    """What a rank runs with, comparable across ranks (a NaN equal to a NaN): its options
    and settings at the first and the second step, its order and its names."""
    first = {**DEFAULTS, **spec.get("construct", {})}
    second = {**first, **spec.get("later", {})}
    return repr((first, second, bool(spec.get("reverse")), spec.get("rename", {})))


@pytest.mark.parametrize("world_size", [2, 3])
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_perturbed_ranks_agree_or_all_raise(world_size: int, data: st.DataObject) -> None:
    spec = data.draw(st.lists(RANK, min_size=world_size, max_size=world_size), label="spec")
    results = run_distributed(world_size, fuzz_worker, spec, timeout=60)
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1, f"ranks ended differently: {results} for {spec}"
    if len({_effective(s) for s in spec}) > 1:
        assert kinds == {"error"}, f"ranks given different inputs all succeeded: {spec}"
    if kinds == {"ok"}:
        assert len({digest for _, digest in results}) == 1, f"results differ: {spec}"
