"""param_groups on real transformers families: routing, per-part orthogonality, training.

Needs the ``models`` extra (``transformers``); CI installs it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from model_families import (
    EXPECTED,
    FAMILIES,
    build,
    first_update_problems,
    model_update_problems,
    options,
    routing,
)
from warning_probes import documented, logged_counts

import muon_dist

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_table_of_family(family: str, caplog: pytest.LogCaptureFixture) -> None:
    model = build(family)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        groups = muon_dist.param_groups(model, **options(family))
    assert routing(groups) == EXPECTED[family]
    assert logged_counts(caplog.text) == documented()[(family, "tiny")]  # docs: 0 lines


@pytest.mark.parametrize("family", FAMILIES)
def test_first_update_is_orthogonal_per_part_and_expert(family: str) -> None:
    assert first_update_problems(family) == []


def test_unknown_fused_name_warns_with_what_to_pass(caplog: pytest.LogCaptureFixture) -> None:
    """No class says how wqkv is cut: it stays whole, and the warning proposes the parts
    its name counts; the proposed keyword silences it."""
    model = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"wqkv": torch.nn.Linear(8, 24)})})
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        groups = muon_dist.param_groups(model)
    assert "split_sizes" not in groups[0]
    assert r"attn\.wqkv\.weight$ (24x8) is named like fused matrices" in caplog.text
    assert r"pass fused={'attn\\.wqkv\\.weight$': {'split_sizes': [8, 8, 8]}}" in caplog.text
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


# Falcon's fused QKV three ways (FalconAttention._split_heads) and Falcon-H1's mixer
# (FalconH1Mixer: gate, x, B, C, dt): how each forward cuts the outputs.
FALCON = {
    "multi_query": ({"multi_query": True}, {"split_sizes": [32, 8, 8]}),
    "per_head": ({"multi_query": False}, {"split_sizes": [8, 8, 8], "split_groups": 4}),
    "new_architecture": (
        {"new_decoder_architecture": True, "num_kv_heads": 2},
        {"split_sizes": [16, 8, 8], "split_groups": 2},
    ),
}


@pytest.mark.parametrize("variant", FALCON)
def test_falcon_fused_qkv_is_cut_as_its_forward_cuts_it(
    variant: str, caplog: pytest.LogCaptureFixture
) -> None:
    import transformers as hf

    extra, qkv = FALCON[variant]
    config = hf.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, **extra
    )
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        problems = model_update_problems(
            hf.FalconForCausalLM(config),
            lambda name: qkv if name.endswith("query_key_value.weight") else {},
        )
    assert problems == [] and "guessed" not in caplog.text


def test_falcon_h1_mixer_projection_is_cut_into_z_x_b_c_dt() -> None:
    import transformers as hf

    config = hf.FalconH1Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=1,
    )
    torch.manual_seed(0)
    layout = {"split_sizes": [32, 32, 8, 8, 4]}
    problems = model_update_problems(
        hf.FalconH1ForCausalLM(config),
        lambda name: layout if name.endswith("mamba.in_proj.weight") else {},
    )
    assert problems == []
