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
    groups = muon_dist.param_groups(Tiny(tie), num_experts=4, weight_decay=0.1)
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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(6, 18)  # q, k, v: 2 heads of 3 rows each
        self.w13 = nn.Linear(6, 16, bias=False)  # gate + up
        self.proj = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)


def _where(groups: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {n: g for g in groups for n in g["param_names"]}  # type: ignore[union-attr]


def test_overrides_move_parameters_between_muon_and_adamw() -> None:
    def route(name: str, p: torch.Tensor) -> str | None:
        return "adamw" if name == "proj.weight" else None

    for overrides in (route, {r"^proj\.": "adamw"}):
        where = _where(muon_dist.param_groups(Block(), overrides=overrides))
        assert where["proj.weight"]["algorithm"] == "adamw"
        assert "weight_decay" not in where["proj.weight"]  # Muon's adamw_weight_decay
        assert where["w13.weight"]["algorithm"] == "muon"
    where = _where(muon_dist.param_groups(Tiny(False), overrides={"tok_embeddings": "muon"}))
    assert where["tok_embeddings.weight"]["algorithm"] == "muon"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"proj": "sgd"}, r"overrides\['proj'\]='sgd'; choose one of \['muon', 'adamw'\]"),
        (lambda n, p: "lion", "overrides returned 'lion' for wqkv.weight"),
        ({"norm": "muon"}, r"routed norm.weight \(shape \(6,\)\) to 'muon'"),
    ],
)
def test_bad_overrides_raise(overrides: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.param_groups(Block(), overrides=overrides)  # type: ignore[arg-type]


def test_fused_weights_are_declared_not_guessed() -> None:
    groups = muon_dist.param_groups(
        Block(),
        fused={
            r"wqkv\.weight$": {"split_sizes": [6, 6, 6], "num_heads": [2, 2, 2]},
            r"w13\.weight$": {"split_sizes": [8, 8]},
        },
    )
    where = _where(groups)
    assert where["wqkv.weight"]["split_sizes"] == [6, 6, 6]
    assert where["wqkv.weight"]["num_heads"] == [2, 2, 2]
    assert where["w13.weight"]["split_sizes"] == [8, 8] and "num_heads" not in where["w13.weight"]
    assert "split_sizes" not in where["proj.weight"]
    assert where["wqkv.bias"]["algorithm"] == "adamw"
    table = muon_dist.Muon(groups).routing_table()
    assert "wqkv.weight[6:12]" in table and "heads 2x[3x6]" in table
    assert "w13.weight[8:16]" in table and "matrix 8x6" in table


@pytest.mark.parametrize(
    ("fused", "message"),
    [
        ({"wqkv": {"split": [6, 12]}}, r"fused\['wqkv'\] has keys \['split'\]"),
        ({"wo": {"num_heads": 2}}, r"fused patterns \['wo'\] match no Muon matrix"),
        ({"w": {"num_heads": 2}, "proj": {"num_heads": 3}}, "matches several fused patterns"),
        ({"w13": {"split_sizes": [8, 4]}}, r"split_sizes=\[8, 4\]"),
    ],
)
def test_bad_fused_declarations_raise(fused: dict[str, dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.param_groups(Block(), fused=fused)


def test_routing_table_counts_parameters_in_millions() -> None:
    model = nn.Sequential(nn.Linear(1000, 1500), nn.Linear(1500, 10))
    table = muon_dist.Muon(muon_dist.param_groups(model)).routing_table()
    assert "1.50" in table.splitlines()[2]  # 0.weight: 1.5M parameters, two decimals
    assert table.splitlines()[-1] == "total adamw: 0.00M, muon: 1.51M"
