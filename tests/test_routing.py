"""param_groups: what goes to Muon and what to AdamW, and the routing table."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.routing import normalize_fqn


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 8, 6))
        self.fused = nn.Parameter(torch.randn(4 * 3, 6))


class Tiny(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(20, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.experts = Experts()
        self.output = nn.Linear(6, 20, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


@pytest.mark.parametrize("tie", [False, True])
def test_param_groups_route_by_role(tie: bool) -> None:
    groups = muon_dist.param_groups(Tiny(tie), num_experts=4)
    where = {
        n: (g["algorithm"], g.get("experts"), g.get("num_experts"))
        for g in groups
        for n in g["param_names"]
    }
    assert where["proj.weight"] == ("muon", None, None)
    assert where["experts.w1"][:2] == ("muon", True)
    assert where["experts.fused"] == ("muon", None, 4)
    assert where["tok_embeddings.weight"][0] == "adamw"
    assert ("output.weight" in where) is not tie
    for name in ("proj.bias", "norm.weight", "norm.bias"):
        assert where[name][0] == "adamw"
    decay = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert decay["tok_embeddings.weight"] == 0.1 and decay["norm.weight"] == 0.0


def test_fused_experts_without_num_experts_are_plain_matrices() -> None:
    groups = muon_dist.param_groups(Tiny(False))
    names = [
        n
        for g in groups
        if g["algorithm"] == "muon" and not g.get("experts")
        for n in g["param_names"]
    ]
    assert "experts.fused" in names


def test_wrapper_names_are_normalised() -> None:
    raw = "module._orig_mod.layers.0._checkpoint_wrapped_module.attn._fsdp_wrapped_module.wq.weight"
    assert normalize_fqn(raw) == "layers.0.attn.wq.weight"


def test_routing_table_logged_and_available(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        groups = muon_dist.param_groups(Tiny(False), num_experts=4)
    assert "experts.w1" in caplog.text and "expert_stack 4x[8x6]" in caplog.text
    table = muon_dist.Muon(groups).routing_table()
    assert "fused_experts 4x[3x6]" in table and "output.weight" in table
    assert table.splitlines()[-1].startswith("total adamw:")
