"""param_groups on real transformers families: routing, per-part orthogonality, training.

Needs the ``models`` extra (``transformers``); CI installs it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from dist_harness import run_distributed
from model_families import (
    FAMILIES,
    build,
    expected,
    first_update_problems,
    options,
    routing,
    train_families,
)

import muon_dist

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_table_of_family(family: str, caplog: pytest.LogCaptureFixture) -> None:
    model = build(family)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        groups = muon_dist.param_groups(model, **options(family))
    assert routing(groups) == expected(family)
    assert "guessed" not in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_first_update_is_orthogonal_per_part_and_expert(family: str) -> None:
    assert first_update_problems(family) == []


# Dense, MoE ([E, out, in], [E, in, out], fused 2-D), Conv1D, interleaved and hybrid
# state-space layouts, trained under FSDP2.
TRAINED = ("qwen3_moe", "gpt_oss", "phi3", "llama4", "gpt2", "dbrx", "qwen3_next", "mamba2")


@pytest.mark.slow
def test_families_train_under_fsdp2_on_two_ranks() -> None:
    reports = run_distributed(2, train_families, TRAINED)
    for family in TRAINED:
        report = reports[0][family]
        assert report["routing"] == expected(family), family
        assert report["problems"] == [], (family, report["problems"])
        losses = report["losses"]
        assert losses[-1] < losses[0], (family, losses)
        assert reports[1][family]["losses"] == pytest.approx(losses), family


def test_unknown_fused_name_warns_with_what_to_pass(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"wqkv": torch.nn.Linear(8, 24)})})
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(model)
    assert r"attn\.wqkv\.weight$ (24x8) is named like fused matrices" in caplog.text
    assert r"fused={'attn\\.wqkv\\.weight$': {'split_sizes': [...]}}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(model, fused={r"wqkv\.weight$": {"split_sizes": [8, 8, 8]}})
    assert caplog.text == ""


def test_readme_family_table_is_rendered_from_these_models() -> None:
    from model_families import family_table
    from repo_paths import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- table:families -->\n", 1)[1].split("\n<!-- /table:families -->")[0]
    assert section == family_table(), "run: python tools/family_table.py"
