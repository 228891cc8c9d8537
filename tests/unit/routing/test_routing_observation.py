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
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from forward_provenance import Provenance, part_codes
from routing_cases import DEEP, OBSERVED
from torch import nn
from warning_probes import documented, warning_counts

import muon_dist
from muon_dist.routing.forward import _repeated_blocks, observe
from muon_dist.routing.param_groups import route_model


@pytest.mark.parametrize("size", ["tiny", "real"])
@pytest.mark.parametrize("family", OBSERVED)
def test_family_no_class_names_is_routed_as_its_forward_cuts_it(
    family: str, size: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    model, kwargs = OBSERVED[family].model(size)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        routes = route_model(model)
    for pattern, want in OBSERVED[family].expected(kwargs).items():
        hits = [(n, r) for n, (_, r) in routes.items() if re.search(pattern, n)]
        assert hits, pattern
        for name, route in hits:
            assert dict(route.options) == want, (name, route.reason)
            assert "observed" in route.reason
    assert warning_counts(routes) == documented()[(family, size)]


@pytest.mark.parametrize("family", sorted(DEEP))
def test_repeated_blocks_observed_once_equal_every_block_traced(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The later layers do not run and take the first layer's observation: the same, for
    every parameter, as tracing every layer; a layer of another kind is no twin."""
    pytest.importorskip("transformers")
    build, kwargs = DEEP[family]
    torch.manual_seed(0)
    built = build(kwargs)
    groups = _repeated_blocks(built)
    assert max(len(g) for g in groups) >= 3  # some layers really run untraced
    assert all(len({type(m) for m in g}) == 1 for g in groups)
    every = observe(built, twins=False)
    ran: Counter[nn.Module] = Counter()
    for kind in {type(m) for g in groups for m in g}:
        monkeypatch.setattr(kind, "forward", _counted(kind.forward, ran))
    once = observe(built)
    assert every.error is None and once.error is None
    assert list(once.by_name) == list(every.by_name)
    for name, seen in every.by_name.items():
        assert once.by_name[name] == seen, name
    assert sum(not ran[m] for g in groups for m in g) >= 2  # answered for, never run


def _counted(forward: Callable[..., Any], ran: Counter[nn.Module]) -> Callable[..., Any]:
    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        ran[self] += 1
        return forward(self, *args, **kwargs)

    return counting


class _BoxHead(nn.Module):
    """Two twin hidden layers and an output layer in one list (RT-DETR's box heads)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        self.layers.append(nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


class _Refiner(nn.Module):
    """A list of twin box heads, each a list holding twins of its own."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(_BoxHead(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(x) for head in self.heads], dim=1)


def test_twins_nested_in_twins_are_observed_as_when_every_block_is_traced() -> None:
    """An untraced box head takes what its traced twin showed inside it, including the
    layer that ran untraced inside that twin: every parameter is observed, the same as
    tracing every block (the untraced inner layer was missing before)."""
    model = _Refiner(width=8, depth=3)
    x = torch.zeros(2, 8)
    once, every = observe(model, x), observe(model, x, twins=False)
    assert len(_repeated_blocks(model)) == 4  # the heads, and each head's hidden layers
    assert sorted(once.by_name) == sorted(every.by_name)
    assert len(once.by_name) == 9 and once.by_name == every.by_name
    assert {s.kind for n, s in once.by_name.items() if "layers.2" in n} == {"head"}


class _Log:
    """What blocks write as they run, read after them (a cache): an object, not a tree."""

    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []


class _Block(nn.Module):
    """Hands back the ``bias`` it is given (T5's position bias); logs its input where given
    a log; ``ran`` holds each block as it runs."""

    def __init__(self, width: int, ran: list[nn.Module]) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.ran = ran

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, log: _Log | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.ran.append(self)
        if log is not None:
            log.items.append(x)
        return torch.relu(self.mix(x)) + bias, bias


class _Blocks(nn.Module):
    """Twin blocks; the head reads every block's log where ``logged``, and the forward
    hooks each block's inner layer where ``hooked`` (Transformers' output capture)."""

    def __init__(self, width: int, depth: int, logged: bool, hooked: bool) -> None:
        super().__init__()
        self.ran: list[nn.Module] = []
        self.embed, self.bias = nn.Linear(width, width), nn.Linear(width, width)
        self.blocks = nn.ModuleList(_Block(width, self.ran) for _ in range(depth))
        self.head = nn.Linear(width * depth if logged else width, 4)
        self.logged, self.hooked = logged, hooked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        if self.hooked:
            for block in self.blocks:
                block.mix.register_forward_hook(lambda m, a, out: seen.append(out))
        h, bias = self.embed(x), self.bias(x)
        log = _Log() if self.logged else None
        for block in self.blocks:
            h, bias = block(h, bias, log)
        return self.head(torch.cat(log.items, dim=-1) if log else h)


@pytest.mark.parametrize(
    ("logged", "hooked", "runs"), [(False, False, 1), (True, False, 1 + 4), (False, True, 4)]
)
def test_untraced_twins_run_only_where_not_running_them_would_differ(
    logged: bool, hooked: bool, runs: int
) -> None:
    """Blocks called alike do not run; a log that later code reads fails the forward
    without them (the traced one ran), which is then traced again with them run; a hook
    inside them keeps them running. Each way, the same observation as tracing every
    block."""
    model, x = _Blocks(8, 4, logged, hooked), torch.zeros(2, 8)
    once = observe(model, x)
    assert len(model.ran) == runs
    every = observe(model, x, twins=False)
    assert once.error is None and len(once.by_name) == 7 and once.by_name == every.by_name


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
    assert r"rel_attn\\.(q|k|v|o)$': 'muon:flat'} [4 parameters]" in text  # one line
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
    assert "(input_gate_weight|recurrent_gate_weight)$': 'muon:slice'}" in text
    assert "muon:flat" not in text


def test_moshi_depth_decoder_stacks_are_offered_slice_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Moshi's depth decoder holds one matrix per codebook in each ``[codebooks, out, in]``
    weight (MoshiFlexibleLinear: ``index_select`` of the codebooks, each matrix
    transposed, a ``matmul`` batched over the codebooks): the warning offers 'muon:slice'
    alone, and passing it puts them on Muon in that mode; its audio heads ``lm_heads``
    (one per codebook, feeding ``audio_logits``) go to AdamW as heads, unwarned. Only
    text and audio labels make the forward reach the depth decoder, whose embedding loop
    reads ``.item()`` of each codebook position, and the text decoder reads its position
    ids' values without a cache: the inputs carry the depth embeddings and a cache."""
    hf = pytest.importorskip("transformers")
    mimi = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    mimi |= {"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32}
    mimi |= {"codebook_size": 16, "codebook_dim": 8, "num_filters": 4, "upsample_groups": 16}
    mimi |= {"upsampling_ratios": [2, 2], "num_quantizers": 4, "num_semantic_quantizers": 1}
    mimi |= {"vector_quantization_hidden_dimension": 8, "sampling_rate": 400}
    depth = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    depth |= {"num_key_value_heads": 2, "ffn_dim": 48, "input_size": 32, "vocab_size": 64}
    depth |= {"audio_vocab_size": 16, "sliding_window": 8, "max_position_embeddings": 8}
    config = hf.MoshiConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        ffn_dim=64,
        num_codebooks=2,
        audio_vocab_size=16,
        max_position_embeddings=16,
        sliding_window=16,
        audio_encoder_config=mimi,
        depth_decoder_config=depth,
    )
    with torch.device("meta"):
        model = hf.MoshiForConditionalGeneration(config)
    codes = torch.zeros(1, 2, 3, dtype=torch.long)
    text = torch.zeros(1, 3, dtype=torch.long)
    inputs = {"input_ids": text, "text_labels": text, "audio_labels": codes}
    inputs |= {"user_audio_codes": codes, "moshi_audio_codes": codes}
    inputs |= {"depth_decoder_inputs_embeds": torch.zeros(3, 2, 16)}
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        cache = {"past_key_values": hf.DynamicCache(config=config)}
        muon_dist.param_groups(model, example_inputs=inputs | cache)
    stacks = [w for w in _warnings(caplog).splitlines() if w.startswith("- depth_decoder")]
    covered = sum(int(w.rsplit("[", 1)[1].split()[0]) for w in stacks)
    assert covered == 1 + 6 * 2  # input_projections; q, k, v, o, fc1, fc2 of 2 layers
    assert all("\\.weight$': 'muon:slice'} [" in w for w in stacks), stacks
    assert "muon:flat" not in caplog.text and "lm_heads" not in caplog.text
    slice_ = r"depth_decoder\.(input_projections|layers\.\d+\.(self_attn\.\w+\.linear|mlp\.fc\d))"
    cache = {"past_key_values": hf.DynamicCache(config=config)}
    overrides = {rf"{slice_}\.weight$": "muon:slice"}
    groups = muon_dist.param_groups(model, example_inputs=inputs | cache, overrides=overrides)
    mode = {n: (g["algorithm"], g.get("muon_mode")) for g in groups for n in g["param_names"]}
    assert mode["depth_decoder.layers.1.mlp.fc2.weight"] == ("muon", "slice")
    assert mode["depth_decoder.input_projections.weight"] == ("muon", "slice")
    assert mode["depth_decoder.lm_heads.weight"] == ("adamw", None)


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
    """muon_dist's warnings (not transformers' about its configs and backends)."""
    return "\n".join(
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("muon_dist")
    )


def _mllama(tiles: int) -> nn.Module:
    """A tiny Mllama with ``tiles`` tiles per image (its image processor makes 4)."""
    hf = pytest.importorskip("transformers")
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_global_layers": 1, "attention_heads": 4, "image_size": 32}
    vision |= {"patch_size": 8, "max_num_tiles": tiles, "intermediate_layers_indices": [0]}
    vision |= {"vision_output_dim": 64}
    if tiles != 4:  # the config's defaults are the published ones, for 4 tiles
        vision |= {"supported_aspect_ratios": [[1, 1], [1, 2]]}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"cross_attention_layers": [1], "pad_token_id": 0}
    config = hf.MllamaConfig(vision_config=vision, text_config=text)
    return hf.MllamaForConditionalGeneration(config)


def test_mllama_vision_tower_is_observed_on_its_image_processors_inputs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mllama's forward takes tiled pixels, aspect ratio ids and a tile mask, which only
    its image processor knows how to make: the default inputs add what that processor
    makes of one blank image of the config's size, so the vision tower is observed and its
    positional table (added to the patches, not a linear map) goes to AdamW unwarned."""
    model = _mllama(tiles=4)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        routes = route_model(model)
        muon_dist.param_groups(model)
    table = routes["model.vision_model.gated_positional_embedding.embedding"][1]
    assert table.algorithm == "adamw" and "lookup table (observed" in table.reason
    assert _warnings(caplog) == ""
    seen = observe(model).by_name  # the tower, the projector and the cross-attention
    reached = ["vision_model.global_transformer.layers.0.mlp.fc1", "multi_modal_projector"]
    reached.append("language_model.layers.1.cross_attn.k_proj")
    assert all(f"model.{name}.weight" in seen for name in reached)


def test_mllama_table_the_inputs_do_not_reach_is_warned_once_with_adamw_proposed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With 2 tiles the config disagrees with its image processor (4): the forward
    rejects the processor's image, the text is observed without it (INFO says so), and
    the positional table it no longer reaches, a bare parameter (no linear module's
    weight), is named in one warning that proposes AdamW with the one ``overrides=`` to
    paste and the inputs that let the forward settle it; it offers no pin of the route
    taken (one whole matrix on Muon), which the evidence argues against."""
    model = _mllama(tiles=2)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        muon_dist.param_groups(model)
    assert "observed the forward as it stands on its dummy token ids;" in caplog.text
    lines = [line for line in _warnings(caplog).splitlines() if "gated_positional" in line]
    assert len(lines) == 1, lines
    regex = r"model\\.vision_model\\.gated_positional_embedding\\.embedding$"
    assert f"until you pass overrides={{'{regex}': 'adamw'}}" in lines[0]
    settle = "; to have its forward settle the route instead, pass example_inputs= that reach it"
    assert lines[0].endswith(f"{settle} to param_groups [1 parameter]")
    assert "fused=" not in lines[0] and "split_sizes" not in lines[0]
    assert r"language_model\.layers\.\d+\.self_attn" not in _warnings(caplog)  # observed


def _rt_detr(size: str) -> nn.Module:
    hf = pytest.importorskip("transformers")
    if size == "real":
        with torch.device("meta"):
            return hf.RTDetrForObjectDetection(hf.RTDetrConfig())
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
    return hf.RTDetrForObjectDetection(config)


_RT_DETR_HEADS = (
    r"(class_embed\.\d+|bbox_embed\.\d+\.layers\.2|enc_score_head|enc_bbox_head\.layers\.2)"
    r"\.weight$"
)


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_rt_detr_is_observed_in_eval_mode_and_its_heads_go_to_adamw(
    size: str, caplog: pytest.LogCaptureFixture
) -> None:
    """In training mode RT-DETR's encoder layer asks ``torch.isfinite(h).all()`` of its
    activations (an overflow guard that reads values: ``.item()`` on meta, and on fake
    tensors too); in eval mode its forward runs on meta, so observation takes that mode
    (INFO says so) and gives the model its modes back. Its class and box heads feed the
    outputs: AdamW as observed heads; every other matrix is observed, nothing is warned.
    At its published size (built on meta, nothing allocated) its config names no image
    size: the default 224 pixels make 1029 anchors for its 300 queries."""
    model = _rt_detr(size)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        routes = route_model(model)
    where = "one 224x224 image" if size == "real" else "one 64x64 image"
    assert f"observed the forward in eval mode on {where};" in caplog.text
    assert model.training and all(m.training for m in model.modules())
    heads = [n for n in routes if re.search(_RT_DETR_HEADS, n)]
    assert len(heads) == (2 * 6 + 2 if size == "real" else 2 * 2 + 2)
    for name in heads:
        route = routes[name][1]
        assert (route.algorithm, route.reason) == (
            "adamw",
            "output head (observed: its product is the model's output)",
        ), name
    assert "not observed" not in caplog.text
    assert [r.guess for _, r in routes.values() if r.guess] == []  # param_groups warns these


def test_lfm2_unobserved_in_proj_is_never_called_q_k_v(caplog: pytest.LogCaptureFixture) -> None:
    """Where LFM2's forward says nothing (inputs it rejects), ``conv.in_proj`` (B, C, x)
    is warned as unobserved with the one ``fused=`` that pins the route taken (whole) and
    no other route beside it; neither the warning nor the audit calls its parts q, k, v,
    even where the config's head sizes add up to its outputs."""
    pytest.importorskip("transformers")
    kwargs = OBSERVED["lfm2"].tiny | {"num_key_value_heads": 4}  # q + k + v = 3 * hidden
    model = OBSERVED["lfm2"].build(kwargs)
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        muon_dist.param_groups(model, example_inputs={"no_such_input": torch.zeros(1)})
    (line,) = [w for w in _warnings(caplog).splitlines() if "in_proj" in w]
    assert line.startswith(r"- model\.layers\.\d+\.conv\.in_proj\.weight$ (96x32) was not observed")
    regex = r"model\\.layers\\.\\d+\\.conv\\.in_proj\\.weight$"
    assert line.endswith(
        f"silence this, pass fused={{'{regex}': {{'split_sizes': [96]}}}} [1 parameter]"
    )
    advice = line.split("how it is applied: ")[1]  # after the forward's own error
    assert " or " not in advice and "overrides=" not in advice
    assert "q 32 + k 32" not in caplog.text and "q/k/v" not in caplog.text


def test_observation_leaves_transformers_output_capture_in_place() -> None:
    """Transformers installs its output-capture hooks on the first forward that asks for
    hidden states, marks the model, and counts on them after: Aya Vision's projector reads
    its vision tower's hidden states. An observation that causes the install keeps those
    hooks, so the model's own forwards still capture, and a second observation sees what
    the first saw."""
    pytest.importorskip("transformers")
    case = OBSERVED["aya_vision"]
    model = case.build(case.tiny)
    first = observe(model)
    marked = [m for m in model.modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    assert marked, "the observation asked for no hidden states: nothing to check"
    for module in marked:
        hooks = [h for sub in module.modules() for h in sub._forward_hooks.values()]
        assert any(h.__module__.startswith("transformers.utils.output_capturing") for h in hooks)
    assert observe(model).by_name == first.by_name
