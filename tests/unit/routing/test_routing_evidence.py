"""Routing by evidence (issue 36): families whose sizes add up by coincidence route as
their modeling code reads them, at tiny and at real sizes (meta device), and their first
update is orthogonal per part and per expert; the escape hatches never raise on a route
the routing proposed.

Needs the ``models`` extra (``transformers``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from model_families import model_update_problems
from routing_cases import CASES
from torch import nn
from warning_probes import Row, documented, warning_counts

import muon_dist
from muon_dist.routing.param_groups import route_model

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


def _problems(
    model: nn.Module, expected: dict[str, Any], row: Row | None = None, **routing: Any
) -> list[str]:
    """Where the routes differ from ``expected``; and where the routing warning's lines
    and the parameters they cover differ from the docs' ``row``."""
    routes = route_model(model, **routing)
    problems = []
    if row is not None and warning_counts(routes) != documented()[row]:
        problems.append(f"{row}: warned {warning_counts(routes)}, docs say {documented()[row]}")
    for pattern, want in expected.items():
        hits = [(n, r) for n, (_, r) in routes.items() if re.search(pattern, n)]
        if not hits:
            problems.append(f"{pattern}: matches no parameter")
        for name, route in hits:
            got = "adamw" if route.algorithm == "adamw" else dict(route.options)
            if got != want:
                problems.append(f"{name}: {got} ({route.reason}), not {want}")
    return problems


@pytest.mark.parametrize("size", ["tiny", "real"])
@pytest.mark.parametrize("family", CASES)
def test_route_follows_the_modeling_code(
    family: str, size: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, kwargs = CASES[family].model(size)
    assert _problems(model, CASES[family].expected(kwargs), (family, size)) == []


def _layout(expected: dict[str, Any]) -> Any:
    def layout_of(name: str) -> dict[str, Any]:
        for pattern, want in expected.items():
            if re.search(pattern, name) and isinstance(want, dict):
                return {k: list(v) if isinstance(v, tuple) else v for k, v in want.items()}
        return {}

    return layout_of


FORWARD = ("minimax", "persimmon", "codegen", "jetmoe", "gpt_oss_20b", "llama4_square")
FORWARD += ("mistral_small_4", "gemma3_vlm", "qwen3_5", "deepseek_v2_lite", "switch")
FORWARD += ("kimi_linear", "zamba2", "xlstm_fused")


@pytest.mark.parametrize("family", FORWARD)
def test_first_update_is_orthogonal_per_part_and_expert(family: str) -> None:
    model, kwargs = CASES[family].model("tiny")
    assert model_update_problems(model, _layout(CASES[family].expected(kwargs))) == []


def test_escape_hatches_never_raise_on_a_proposed_route(caplog: pytest.LogCaptureFixture) -> None:
    """fused= replaces the routing's parts and expert count, overrides= moves anything,
    on routes the family table made and on those it only proposed."""
    model, _ = CASES["jetmoe"].model("tiny")
    routes = muon_dist.param_groups(
        model,
        fused={
            r"mlp\.input_linear\.weight$": {"split_sizes": [96]},  # keep gate+up whole
            r"kv_proj\.weight$": {"num_experts": 2},
            r"experts\.router\.layer\.weight$": {"transposed": True},
        },
        overrides={r"mlp\.router\.layer\.weight$": "adamw"},
    )
    views = {e.name: e.view for e in muon_dist.routing.table.routing_entries(routes)}
    assert views["model.layers.0.mlp.input_linear.weight"] == "expert_stack 4x[96x32] parts 96"
    assert views["model.layers.0.self_attention.kv_proj.weight"].startswith("fused_experts 2x")
    ernie, _ = CASES["ernie4_5_moe"].model("tiny")
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        routes = muon_dist.param_groups(  # what the audit proposes for shared experts
            ernie,
            fused={r"shared_experts\.(gate|up)_proj\.weight$": {"split_sizes": [12, 12]}},
            observe=False,  # its grouped kernel does not run on meta at tiny sizes: warned
        )
    assert caplog.text == ""


def test_config_sums_only_propose_in_the_audit(capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = CASES["deepseek_v2_lite"].model("tiny")
    muon_dist.param_groups(model, report=True, observe=False)  # the forward would settle it
    audit = capsys.readouterr().out
    row = next(line for line in audit.splitlines() if "shared_experts.gate_proj" in line)
    assert "whole: no module class says it is fused" in row and "parts" not in row
