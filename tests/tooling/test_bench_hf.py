"""benchmarks/bench_hf.py on CPU: a tiny Qwen3-MoE under FSDP2 (gloo, one process) trained
by AdamW and Muon (fp32 and bf16 momenta) interleaved, its JSON and the ``hf`` table from
it; Qwen3-MoE's fused expert stacks routed to Muon as expert stacks; --momentum-dtype."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_hf

import muon_dist


def test_a_tiny_run_writes_its_json_and_table(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_hf.py"), "--model", "qwen3-moe"]
    argv += ["--tiny", "--batch", "2", "--seq", "16", "--steps", "3", "--skip", "1"]
    argv += ["--repeats", "1", "--variants", "adamw", "muon", "--json", str(out)]
    argv += ["--momentum-dtype", "fp32", "bf16"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results["runs"]] == ["adamw", "muon", "muon-bf16m"]
    for run in results["runs"]:
        assert len(run["step_s"]) == 3 and min(run["step_s"]) > 0 and run["peak_gib"] is None
    # On CPU cuda_graph="auto" (bench_hf's muon) runs eagerly and says why.
    assert "cpu" in results["runs"][1]["note"]
    summary = results["summary"]
    assert summary["adamw"]["vs_baseline"]["median"] == 1.0
    assert summary["muon"]["tokens_per_s"]["median"] > 0
    assert summary["muon-bf16m"]["tokens_per_s"]["median"] > 0
    assert all(math.isfinite(run["last_loss"]) for run in results["runs"])
    # The summary's last loss is the runs' (one run each here).
    for run in results["runs"]:
        assert summary[run["variant"]]["last_loss"]["median"] == run["last_loss"]
    assert "| qwen3-moe (tiny, " in done.stdout and "| muon |" in done.stdout
    assert "| muon-bf16m |" in done.stdout
    again = bench_hf.report(results, write_table=False)
    assert again.splitlines()[0].startswith("| model | GPUs | batch × seq | optimizer |")
    assert "| last loss |" in again.splitlines()[0]


def test_qwen3_moe_fused_experts_are_routed_as_expert_stacks() -> None:
    import transformers

    spec = bench_hf.MODELS["qwen3-moe"]
    config = transformers.Qwen3MoeConfig(**spec.tiny)
    model = transformers.Qwen3MoeForCausalLM(config)
    experts = {
        name: group.get("experts", False)
        for group in muon_dist.param_groups(model)
        for name in group["param_names"]
        if group["algorithm"] == "muon" and ".experts." in name
    }
    assert sorted(experts) == [
        f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj", "gate_up_proj")
    ]
    assert all(experts.values())


def test_momentum_dtypes_run_each_muon_variant_side_by_side() -> None:
    """--momentum-dtype fp32 bf16 adds each Muon variant's -bf16m twin right after it (not
    AdamW's, nor one already listed); bf16 alone replaces them; a -bf16m variant builds its
    optimizer with bf16 momenta."""
    both = bench_hf.parse_args(["--variants", "adamw", "muon", "dion2-eager", "muon-bf16m"])
    assert both.variants == ["adamw", "muon", "dion2-eager", "muon-bf16m"]
    both = bench_hf.parse_args(
        ["--variants", "adamw", "muon", "dion2-eager", "--momentum-dtype", "fp32", "bf16"]
    )
    assert both.variants == ["adamw", "muon", "muon-bf16m", "dion2-eager", "dion2-eager-bf16m"]
    only = bench_hf.parse_args(["--variants", "adamw", "normuon", "--momentum-dtype", "bf16"])
    assert only.variants == ["adamw", "normuon-bf16m"]
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--variants", "adamw-bf16m"])
