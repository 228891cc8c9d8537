"""Each collective runs on the smallest group holding the parameters' shards (4 gloo ranks)."""

from __future__ import annotations

from dist_harness import run_distributed
from group_cases import (
    hsdp_worker,
    pipeline_worker,
    plain_subgroup_worker,
    two_meshes_worker,
)
from parity_cases import parity_violations


def test_pipeline_stages_each_with_own_muon_match_reference() -> None:
    results = run_distributed(4, pipeline_worker)
    for rank, result in enumerate(results):
        assert not parity_violations(result["errors"], "fp32"), (rank, result["errors"])
        kinds = {name for name, _ in result["calls"]}
        assert {"all_to_all_single", "all_reduce", "all_gather_object"} <= kinds, kinds
        wrong = {c for c in result["calls"] if c[1] != result["stage_ranks"]}
        assert not wrong, f"rank {rank}: collectives outside its stage: {wrong}"


def test_hsdp_redundant_exchanges_within_the_shard_group() -> None:
    results = run_distributed(4, hsdp_worker, "redundant")
    for rank, result in enumerate(results):
        assert not parity_violations(result["errors"], "fp32"), (rank, result["errors"])
        exchanges = {ranks for name, ranks in result["calls"] if name == "all_to_all_single"}
        assert exchanges == {result["shard_group"]}, (rank, exchanges)
        others = {ranks for name, ranks in result["calls"] if name != "all_to_all_single"}
        assert others == {(0, 1, 2, 3)}, (rank, others)


def test_stage_on_two_meshes_gets_a_group_of_its_own_ranks() -> None:
    for rank, result in enumerate(run_distributed(4, two_meshes_worker)):
        assert max(result["errors"]) <= 1e-5, (rank, result["errors"])
        wrong = {c for c in result["calls"] if c[1] != result["stage_ranks"]}
        assert result["calls"] and not wrong, f"rank {rank}: collectives outside its stage: {wrong}"


def test_plain_replicas_on_a_subgroup_with_process_group() -> None:
    for rank, result in enumerate(run_distributed(4, plain_subgroup_worker)):
        assert max(result["errors"]) <= 1e-5, (rank, result["errors"])
        wrong = {c for c in result["calls"] if c[1] != result["stage_ranks"]}
        kinds = {name for name, _ in result["calls"]}
        assert "all_to_all_single" in kinds and not wrong, (rank, kinds, wrong)
