"""overlap="backward": bitwise equal to the plain step, started during backward, and every
rank leaves everything as it was on a non-finite gradient (cases in overlap_cases.py)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from overlap_cases import overlap_worker
from torch import nn

import muon_dist


# test_backward_overlap_slow.py runs the other layouts.
@pytest.mark.parametrize(
    ("world_size", "layout"), [(2, "fsdp"), (2, "normuon"), (2, "frozen"), (2, "bf16_momentum")]
)
def test_bitwise_equal_to_plain_step(world_size: int, layout: str) -> None:
    outs = run_distributed(world_size, overlap_worker, "parity", layout)
    # Every rank started the same all-to-alls in the same order: the k-th exchange of each
    # rank sends each peer what that peer's k-th exchange expects from it.
    calls = [out["exchanges"] for out in outs]
    assert len({len(c) for c in calls}) == 1 and calls[0], [len(c) for c in calls]
    for k in range(len(calls[0])):
        for r in range(world_size):
            for q in range(world_size):
                assert calls[r][k][0][q] == calls[q][k][1][r], (k, r, q)
    for rank, out in enumerate(outs):
        assert out["equal"], f"rank {rank}: parameters or state differ"
        assert out["redone"] == 0, f"rank {rank}: unedited steps ran their buckets again"
        # Some buckets started during every backward, and not all of them at its end.
        assert all(count > 0 for count in out["started"]), out
        assert out["buckets"] > 1, out
        # What waits for step() is at most this rank's pieces of the updates: no stacks.
        assert all(held <= out["shard_bytes"] for held in out["held"]), out


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reduce_every_micro_batch"])
def test_gradient_accumulation(no_sync: bool) -> None:
    for rank, out in enumerate(run_distributed(2, overlap_worker, "accumulation", no_sync)):
        assert out["equal"], f"rank {rank}: parameters or state differ"
        first_micro = [count for micro, count in out["started"] if micro == 0]
        if no_sync:
            assert first_micro == [0, 0], out  # nothing starts before the reducing backward
            assert out["restarts"] == 0, out
        else:
            assert all(count > 0 for count in first_micro), out
            assert out["restarts"] == 2, out  # once per step: the second micro-batch


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
@pytest.mark.parametrize("target", ["last", "first"], ids=["first_bucket", "last_bucket"])
def test_nonfinite_gradient_changes_nothing(policy: str, target: str) -> None:
    for rank, out in enumerate(run_distributed(2, overlap_worker, "nonfinite", policy, target)):
        assert out["unchanged"] == [True, True], f"rank {rank}: {out}"
        assert out["equal"], f"rank {rank}: the modes differ after the bad step"


def test_last_layer_gather_issued_during_backward() -> None:
    for out in run_distributed(2, overlap_worker, "early_gather"):
        events = out["events"]
        assert out["last_layer"] in out["first_bucket_names"], out
        assert events.index("exchange") < events.index("first layer"), events
        assert events.index("exchange") < events.index("backward done"), events


def test_edits_between_backward_and_step_give_the_plain_step() -> None:
    """clip_grad_norm_, in-place scaling, zero_grad(set_to_none=False), a later hook, a
    momentum or Nesterov change, an ns_steps change: the plain step's result, bitwise."""
    for rank, out in enumerate(run_distributed(2, overlap_worker, "edited")):
        for name, result in out.items():
            assert result["equal"], f"rank {rank}, {name}: the modes differ"
            if name not in ("ns_steps",):  # a rebuilt step starts every bucket anew
                assert result["redone"] >= 1, (rank, name, result)


def test_only_gradients_read_during_backward_are_compared() -> None:
    """A gradient scaled in place after the bucket that read it started: that bucket runs
    again. Gradients whose bucket had not started are read at step(): nothing runs again."""
    for out in run_distributed(2, overlap_worker, "edited_where", "started"):
        assert out["equal"] and out["redone"] == 1, out
        assert all(count > 0 for count in out["started"]), out
    for out in run_distributed(2, overlap_worker, "edited_where", "not_started"):
        assert out["equal"] and out["redone"] == 0, out
        assert out["started"] == [0, 0, 0], out


def test_value_changed_on_one_rank_after_the_hooks_refused_on_every_rank() -> None:
    outs = run_distributed(2, overlap_worker, "changed_on_one_rank")
    for out in outs:
        assert len(out["errors"]) == 1, out
        assert "param group 0 momentum ranges from 0.8 to 0.95" in out["errors"][0], out
        assert out["unchanged"] and out["finite"], out


def test_state_dict_round_trip_resumes_bitwise() -> None:
    for out in run_distributed(2, overlap_worker, "resume"):
        assert out["equal"] and out["started"] > 0, out


def test_step_again_without_backward() -> None:
    """A second step() on the same gradients, with no hook run since the last: the plain
    step's result (a stale count of started buckets once made it ask for their norms)."""
    for out in run_distributed(2, overlap_worker, "repeated_step"):
        assert out["equal"], out


def test_plain_tensors_refused() -> None:
    model = nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"overlap='backward': weight is a plain tensor"):
        muon_dist.Muon([{"params": [model.weight], "param_names": ["weight"]}], overlap="backward")


def test_bad_overlap_options_refused() -> None:
    weight = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"overlap='forward' is not supported; choose one of"):
        muon_dist.Muon([weight], overlap="forward")
    with pytest.raises(
        ValueError, match=r"use cuda_graph='auto' \(the default: eager there\) or False"
    ):
        muon_dist.Muon([weight], overlap="backward", cuda_graph=True)


def test_in_place_buffers_change_no_bit_of_an_early_step() -> None:
    for rank, out in enumerate(run_distributed(2, overlap_worker, "in_place")):
        assert out["equal"], f"rank {rank}: parameters or state differ"
        in_place, packed = out["in_place"]
        assert in_place > 0 and packed == 0, out
        # Held updates are this rank's pieces, never a stack or receive buffer kept whole.
        assert all(held <= out["shard_bytes"] for held in out["held"]), out
