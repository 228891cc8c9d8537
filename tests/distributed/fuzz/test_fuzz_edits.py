"""Edit fuzz: random edits of group values and gradients, between steps and between backward
and ``step()``, on every rank or on rank 0 only, under both overlap modes.

Each rank trains the same FSDP2 model with each mode (fuzz_edit_cases.py). An edit
made alike on every rank must leave both modes bitwise equal (or both failing alike on every
rank); a group value set on rank 0 only must fail the step on every rank, in both modes. A
gradient edited on rank 0 only is a legitimate sharded gradient: the modes must agree.
"""

from __future__ import annotations

from typing import Any

from dist_harness import run_distributed
from fuzz_edit_cases import GRAD_EDITS, edit_worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VALUES: dict[str, st.SearchStrategy[Any]] = {
    "lr": st.sampled_from([0.01, 0.05]),
    "momentum": st.sampled_from([0.8, 0.9]),
    "nesterov": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 0.2]),
    "ns_steps": st.sampled_from([3, 4]),
    "adjust_lr": st.sampled_from(["rms_norm", None]),
    "coefficients": st.sampled_from(["polar_express", "keller"]),
    "cautious_wd": st.booleans(),
    "clip_grad_norm_": st.sampled_from([1e-3, 1e3]),
    "grad.mul_": st.sampled_from([0.5, 0.0]),
}


# The values the edits start from (overlap_cases.py's optimizer), per group.
DEFAULTS: list[dict[str, Any]] = [
    {
        "lr": 0.02,
        "momentum": 0.95,
        "nesterov": True,
        "weight_decay": 0.1,
        "ns_steps": 5,
        "adjust_lr": "spectral_norm",
        "coefficients": "quintic",
        "cautious_wd": False,
    },
    {"lr": 3e-4, "weight_decay": 0.0},
]


@st.composite
def _edit(draw: st.DrawFn) -> dict[str, Any]:
    key = draw(st.sampled_from(sorted(VALUES)))
    group = 1 if key in ("lr", "weight_decay") and draw(st.booleans()) else 0
    return {
        "key": key,
        "value": draw(VALUES[key]),
        "group": group,
        "step": draw(st.integers(0, 2)),
        "when": "after backward"
        if key in GRAD_EDITS
        else draw(st.sampled_from(["before backward", "after backward"])),
        # clip_grad_norm_ is itself a collective over the ranks: on every rank or none.
        "rank0_only": key != "clip_grad_norm_" and draw(st.booleans()),
    }


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(edits=st.lists(_edit(), min_size=1, max_size=3))
def test_edits_keep_the_modes_equal_or_fail_on_every_rank(edits: list[dict[str, Any]]) -> None:
    results = run_distributed(2, edit_worker, edits, timeout=120)
    for mode in ("none", "backward"):
        kinds = {r[mode][0] for r in results}
        assert len(kinds) == 1, f"ranks ended differently under {mode}: {results} for {edits}"
    for rank, result in enumerate(results):
        assert result["none"] == result["backward"], f"rank {rank}: {result} for {edits}"
    # A value set on rank 0 alone, never set again by another edit, that differs there.
    differing = [
        e
        for e in edits
        if e["rank0_only"]
        and e["key"] not in GRAD_EDITS
        and e["value"] != DEFAULTS[e["group"]][e["key"]]
        and sum(1 for f in edits if (f["key"], f["group"]) == (e["key"], e["group"])) == 1
    ]
    if differing:
        assert {r["none"][0] for r in results} == {"error"}, f"{results} for {edits}"
