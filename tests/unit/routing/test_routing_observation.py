"""Routing by observation (issue 46): the model's own forward, run once on the meta device,
says how each weight's product is cut, and the route follows it, for families no class
rule names, at tiny and published sizes; random compositions of split, chunk, view and a
depthwise convolution are routed as their forward cuts them, and a wrong route fails the
forward-provenance check.

Needs the ``models`` extra (``transformers``) for the families.
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any

import pytest
import torch
from forward_provenance import Provenance, part_codes
from routing_cases import DEEP, OBSERVED, Case
from torch import nn

import muon_dist
from muon_dist.routing.names import name_regex
from muon_dist.routing.observe import _repeated_blocks, observe
from muon_dist.routing.param_groups import route_model
from muon_dist.routing.route import shape_text


def _build(case: Case, size: str) -> tuple[nn.Module, dict[str, Any]]:
    kwargs = case.tiny if size == "tiny" else case.real
    torch.manual_seed(0)
    if size == "tiny":
        return case.build(kwargs), kwargs
    with torch.device("meta"):
        return case.build(kwargs), kwargs


@pytest.mark.parametrize("size", ["tiny", "real"])
@pytest.mark.parametrize("family", OBSERVED)
def test_family_no_class_names_is_routed_as_its_forward_cuts_it(
    family: str, size: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    model, kwargs = _build(OBSERVED[family], size)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        routes = route_model(model)
    for pattern, want in OBSERVED[family].expected(kwargs).items():
        hits = [(n, r) for n, (_, r) in routes.items() if re.search(pattern, n)]
        assert hits, pattern
        for name, route in hits:
            assert dict(route.options) == want, (name, route.reason)
            assert "observed" in route.reason
    assert "guessed" not in caplog.text


@pytest.mark.parametrize("family", sorted(DEEP))
def test_repeated_blocks_observed_once_equal_every_block_traced(family: str) -> None:
    """The middle layers run untraced and take the first layer's observation: the same,
    for every parameter, as tracing every layer; a layer of another kind is no twin."""
    pytest.importorskip("transformers")
    build, kwargs = DEEP[family]
    torch.manual_seed(0)
    built = build(kwargs)
    groups = _repeated_blocks(built)
    assert max(len(g) for g in groups) >= 3  # some layers really run untraced
    assert all(len({type(m) for m in g}) == 1 for g in groups)
    every, once = observe(built, twins=False), observe(built)
    assert every.error is None and once.error is None
    assert list(once.by_name) == list(every.by_name)
    for name, seen in every.by_name.items():
        assert once.by_name[name] == seen, name


def _tensor_warning(model: nn.Module, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(model)
    return caplog.text


def test_xlnet_projections_are_offered_flat_alone(caplog: pytest.LogCaptureFixture) -> None:
    """XLNet's q, k, v, o ``[d_model, heads, d]`` are read by einsum as one flattened
    matrix: the warning offers that override alone, and passing it puts them on Muon."""
    hf = pytest.importorskip("transformers")
    config = hf.XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4, d_inner=48)
    model = hf.XLNetLMHeadModel(config)
    text = _tensor_warning(model, caplog)
    assert "rel_attn" in text and "q$': 'muon:flat'}" in text
    assert "muon:slice" not in text and "r_w_bias" not in text
    assert "seg_embed$': 'muon" not in text  # a segment table is never invited onto Muon
    groups = muon_dist.param_groups(model, overrides={r"rel_attn\.[qkvo]$": "muon:flat"})
    muon = {n: g.get("muon_mode") for g in groups for n in g["param_names"]}
    assert muon["transformer.layer.0.rel_attn.q"] == "flat"


def test_recurrent_gemma_gates_are_offered_slice_alone(caplog: pytest.LogCaptureFixture) -> None:
    """RecurrentGemma's block-diagonal gates ``[heads, w, w]`` are applied per head
    (``baddbmm``): the warning offers 'muon:slice' alone."""
    hf = pytest.importorskip("transformers")
    config = hf.RecurrentGemmaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        lru_width=32,
        block_types=["recurrent", "attention"],
        head_dim=8,
    )
    text = _tensor_warning(hf.RecurrentGemmaForCausalLM(config), caplog)
    assert "input_gate_weight$': 'muon:slice'}" in text
    assert "muon:flat" not in text


# ---------------------------------------------------------------------------------------
# Random compositions: a projection whose forward cuts it by split, chunk, view + split
# per group, and a nested split after a depthwise convolution


class _Composed(nn.Module):
    """``proj(x)`` cut as ``plan`` says; each piece read by its own linear map."""

    def __init__(self, plan: dict[str, Any], width: int) -> None:
        super().__init__()
        self.plan = plan
        self.proj = nn.Linear(width, plan["outputs"])
        self.heads = nn.ModuleList(nn.Linear(s, width) for s in plan["leaves"])
        inner = plan.get("conv")
        self.conv = nn.Conv1d(inner, inner, 3, groups=inner, padding=2) if inner else None

    def pieces(self, y: torch.Tensor) -> list[torch.Tensor]:
        plan = self.plan
        if plan["kind"] == "chunk":
            return list(y.chunk(len(plan["sizes"]), dim=-1))
        if plan["kind"] == "grouped":
            grouped = y.view(*y.shape[:-1], plan["groups"], sum(plan["sizes"]))
            return [p.flatten(-2) for p in grouped.split(plan["sizes"], dim=-1)]
        first, rest = y.split([plan["sizes"][0], plan["conv"]], dim=-1)
        assert self.conv is not None
        seq = rest.shape[1]
        rest = torch.nn.functional.silu(self.conv(rest.transpose(1, 2))[..., :seq].transpose(1, 2))
        return [first, *rest.split(plan["inner"], dim=-1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = self.pieces(self.proj(x))
        return sum((h(p) for h, p in zip(self.heads, pieces, strict=True)), torch.zeros(()))


def _plan(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    """A cut and the view options that say it."""
    kind = rng.choice(["chunk", "grouped", "nested"])
    if kind == "chunk":
        n, size = rng.choice([2, 3]), rng.choice([4, 8])
        sizes = [size] * n
        return {"kind": kind, "sizes": sizes, "outputs": sum(sizes), "leaves": sizes}, {
            "split_sizes": tuple(sizes)
        }
    if kind == "grouped":
        sizes = [rng.choice([2, 4]) for _ in range(rng.choice([2, 3]))]
        groups = rng.choice([2, 4])
        leaves = [s * groups for s in sizes]
        plan = {"kind": kind, "sizes": sizes, "groups": groups, "leaves": leaves}
        return plan | {"outputs": sum(leaves)}, {
            "split_sizes": tuple(sizes),
            "split_groups": groups,
        }
    first, inner = rng.choice([4, 8]), [rng.choice([4, 8]) for _ in range(3)]
    plan = {"kind": kind, "sizes": [first], "conv": sum(inner), "inner": inner}
    plan |= {"outputs": first + sum(inner), "leaves": [first, *inner]}
    return plan, {"split_sizes": (first, *inner)}


def _provenance_problems(model: nn.Module, x: torch.Tensor, options: dict[str, Any]) -> list[str]:
    """Where a route's parts of ``proj.weight`` are no tensor of the real forward."""
    mode = Provenance(model.proj.weight)
    with torch.no_grad(), mode:
        model(x)
    rows = model.proj.weight.shape[0]
    return [
        f"part {j} is no tensor of the forward"
        for j, part in enumerate(part_codes(options, rows))
        if part not in mode.sets
    ]


@pytest.mark.parametrize("seed", range(12))
def test_random_compositions_route_as_their_forward_cuts(seed: int) -> None:
    rng = random.Random(seed)
    plan, expected = _plan(rng)
    width = 16
    model = _Composed(plan, width)
    x = torch.randn(2, 5, width)
    routes = route_model(model, example_inputs=x)
    options = dict(routes["proj.weight"][1].options)
    assert options == expected, (plan, routes["proj.weight"][1].reason)
    assert _provenance_problems(model, x, options) == []
    wrong = dict(options)
    sizes = list(options["split_sizes"])
    wrong["split_sizes"] = (sizes[0] + 1, sizes[1] - 1, *sizes[2:])  # one row moved
    assert _provenance_problems(model, x, wrong) != []


def test_without_example_inputs_the_class_routes_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain module has no dummy inputs: it is routed as before, and the log names
    what was not observed."""
    model = _Composed(_plan(random.Random(0))[0], 16)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        routes = route_model(model)
    assert "split_sizes" not in dict(routes["proj.weight"][1].options)
    assert "not observed (no example_inputs" in caplog.text and r"proj\.weight$" in caplog.text


# ---------------------------------------------------------------------------------------
# A clean log means a right route: a Muon matrix neither observed nor settled by a class


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_mllama_table_the_inputs_do_not_reach_is_warned_with_both_fixes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mllama's dummy inputs never reach the vision tower: its positional table
    (added to the patches, not a linear map) is named in a warning with the inputs that
    would reach it and the override that puts a table on AdamW."""
    hf = pytest.importorskip("transformers")
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_global_layers": 1, "attention_heads": 4, "image_size": 32}
    vision |= {"patch_size": 8, "max_num_tiles": 2, "intermediate_layers_indices": [0]}
    vision |= {"vision_output_dim": 64, "supported_aspect_ratios": [[1, 1], [1, 2]]}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"cross_attention_layers": [1], "pad_token_id": 0}
    config = hf.MllamaConfig(vision_config=vision, text_config=text)
    model = hf.MllamaForConditionalGeneration(config)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(model)
    lines = [line for line in _warnings(caplog).splitlines() if "gated_positional" in line]
    assert len(lines) == 1, lines
    regex = r"model\\.vision_model\\.gated_positional_embedding\\.embedding$"
    assert "example_inputs= that reach it" in lines[0]
    assert f"overrides={{'{regex}': 'adamw'}}" in lines[0]
    assert r"language_model\.layers\.\d+\.self_attn" not in _warnings(caplog)  # observed


def test_rt_detr_forward_off_meta_warns_each_unsettled_matrix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RT-DETR's forward calls ``.item()``: no observation. Every Muon matrix no class
    settles is warned once, with the ``fused=`` that pins it whole or the override for a
    head (no ``example_inputs=``: no input makes that forward run on meta)."""
    hf = pytest.importorskip("transformers")
    backbone = hf.RTDetrResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"],
    )
    config = hf.RTDetrConfig(
        backbone_config=backbone,
        d_model=32,
        encoder_hidden_dim=32,
        encoder_in_channels=[32, 64, 128],
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        decoder_layers=2,
        num_queries=10,
        num_labels=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        image_size=64,
        decoder_in_channels=[32, 32, 32],
    )
    model = hf.RTDetrForObjectDetection(config)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        routes = route_model(model)
        muon_dist.param_groups(model)
    warned = _warnings(caplog)
    assert "does not run on the meta device" in warned
    assert "example_inputs=" not in warned
    for name, (p, route) in routes.items():
        if route.algorithm == "muon" and p.ndim == 2 and "observed" not in route.reason:
            regex = name_regex(name)
            assert warned.count(f"- {regex} ({shape_text(p.shape)})") == 1, name
            assert f"overrides={{{regex!r}: 'adamw'}}" in warned


def test_lfm2_unobserved_in_proj_is_never_called_q_k_v(caplog: pytest.LogCaptureFixture) -> None:
    """Where LFM2's forward says nothing (inputs it rejects), ``conv.in_proj`` (B, C, x)
    is warned as unobserved, and neither the warning nor the audit calls its parts q, k,
    v, even where the config's head sizes add up to its outputs."""
    pytest.importorskip("transformers")
    kwargs = OBSERVED["lfm2"].tiny | {"num_key_value_heads": 4}  # q + k + v = 3 * hidden
    model = OBSERVED["lfm2"].build(kwargs)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        muon_dist.param_groups(model, example_inputs={"no_such_input": torch.zeros(1)})
    assert r"conv\.in_proj\.weight$ (96x32) was not observed" in _warnings(caplog)
    assert "q 32 + k 32" not in caplog.text and "q/k/v" not in caplog.text
