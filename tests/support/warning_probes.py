"""Families probed for a clean routing log: what param_groups warns of each, line by line.

Tiny configs (random init, no downloads) of the families people use that the family
tests do not build: encoder-decoders, dual encoders, MoE variants, and the module classes
the family table names. ``warning_lines`` counts the lines of muon_dist's one routing
warning and the parameters they cover; ``tools/family_table.py`` renders the README's
warning table from these probes and the tested families, and the tests that route each
family hold its row (``tests/unit/routing/test_routing_warnings.py``: the probes and the
table's rows).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

_W = {"vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_ENC_DEC = _W | {
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "max_position_embeddings": 64,
    "decoder_start_token_id": 2,
}
_T5 = _W | {"d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4}
_T5 |= {"decoder_start_token_id": 0}
_DECODER = _W | {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
_DECODER |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
_TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
_TEXT |= {"num_attention_heads": 4, "max_position_embeddings": 16}
_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
_VISION |= {"num_attention_heads": 4, "image_size": 16, "patch_size": 4}
_MOE = {"num_experts_per_tok": 2}


def _hf() -> Any:
    import transformers

    return transformers


def _make(config: str, model: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        hf = _hf()
        return getattr(hf, model)(getattr(hf, config)(**kwargs))

    return build


PROBES: dict[str, Callable[[], nn.Module]] = {
    # encoder-decoders
    "t5": _make("T5Config", "T5ForConditionalGeneration", **_T5),
    "mt5": _make("MT5Config", "MT5ForConditionalGeneration", **_T5),
    "bart": _make("BartConfig", "BartForConditionalGeneration", **_ENC_DEC),
    "mbart": _make("MBartConfig", "MBartForConditionalGeneration", **_ENC_DEC),
    "pegasus": _make("PegasusConfig", "PegasusForConditionalGeneration", **_ENC_DEC),
    "marian": _make("MarianConfig", "MarianMTModel", **_ENC_DEC),
    "m2m_100": _make("M2M100Config", "M2M100ForConditionalGeneration", **_ENC_DEC),
    "blenderbot": _make("BlenderbotConfig", "BlenderbotForConditionalGeneration", **_ENC_DEC),
    # dual encoders
    "clip": _make(
        "CLIPConfig", "CLIPModel", text_config=_TEXT, vision_config=_VISION, projection_dim=16
    ),
    "siglip": _make("SiglipConfig", "SiglipModel", text_config=_TEXT, vision_config=_VISION),
    # encoders
    "bert": _make("BertConfig", "BertModel", **_TEXT),
    "roberta": _make("RobertaConfig", "RobertaForMaskedLM", **_TEXT | {"pad_token_id": 1}),
    # MoE variants and other decoders
    "olmoe": _make("OlmoeConfig", "OlmoeForCausalLM", **_DECODER | _MOE | {"num_experts": 4}),
    "granitemoe": _make(
        "GraniteMoeConfig", "GraniteMoeForCausalLM", **_DECODER | _MOE | {"num_local_experts": 4}
    ),
    "phimoe": _make(
        "PhimoeConfig", "PhimoeForCausalLM", **_DECODER | _MOE | {"num_local_experts": 4}
    ),
    "mistral": _make("MistralConfig", "MistralForCausalLM", **_DECODER),
    "olmo2": _make("Olmo2Config", "Olmo2ForCausalLM", **_DECODER),
    "bloom": _make(
        "BloomConfig", "BloomForCausalLM", **_W | {"hidden_size": 32, "n_layer": 2, "n_head": 4}
    ),
    "falcon": _make(
        "FalconConfig",
        "FalconForCausalLM",
        **_W | {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    "mamba": _make(
        "MambaConfig",
        "MambaForCausalLM",
        **_W | {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 8},
    ),
    "decision_transformer": _make(
        "DecisionTransformerConfig",
        "DecisionTransformerModel",
        state_dim=4,
        act_dim=2,
        hidden_size=32,
        n_layer=1,
        n_head=4,
        max_ep_len=16,
    ),
    "imagegpt": _make(
        "ImageGPTConfig", "ImageGPTForCausalImageModeling", vocab_size=17, n_embd=32, n_layer=2
    ),
}


def warning_counts(routes: dict[str, Any]) -> tuple[int, int]:
    """``(lines, parameters)`` of the routing warning for ``route_model``'s routes: its
    lines (one per pattern) and the parameters they cover."""
    from muon_dist.routing.param_groups import guess_lines

    lines = guess_lines({name: route for name, (_, route) in routes.items()})
    return len(lines), sum(count for _, count in lines)


def warning_lines(model: nn.Module, **routing: Any) -> tuple[int, int]:
    """:func:`warning_counts` of ``model`` routed with ``routing``."""
    from muon_dist.routing.param_groups import route_model

    torch.manual_seed(0)
    return warning_counts(route_model(model, **routing))


START, END = "<!-- table:warnings -->", "<!-- /table:warnings -->"
Row = tuple[str, str]  # (family, size)


def warning_table(counts: dict[Row, tuple[int, int]]) -> str:
    """The README's warning table: per tested family and size, the lines of the routing
    warning and the parameters they cover."""
    lines = [
        "| family | size | warning lines | parameters they cover |",
        "| --- | --- | --- | --- |",
    ]
    for (family, size), (count, covered) in counts.items():
        lines.append(f"| {family} | {size} | {count} | {covered} |")
    return "\n".join(lines)


def readme_warnings(text: str) -> dict[Row, tuple[int, int]]:
    """The warning table's rows, read back from the README's ``text``."""
    section = text.split(START + "\n", 1)[1].split("\n" + END, 1)[0]
    rows = {}
    for line in section.splitlines()[2:]:
        family, size, count, covered = (cell.strip() for cell in line.strip("|").split("|"))
        rows[(family, size)] = (int(count), int(covered))
    return rows


def families_tested() -> dict[Row, Callable[[], tuple[nn.Module, dict[str, Any]]]]:
    """Every family the routing tests build, by (family, size): the family tests' (tiny),
    the cases of ``tests/unit/routing/routing_cases.py`` (tiny and published sizes) and
    the probes here (tiny), each as ``() -> (model, param_groups arguments)``."""
    import model_families
    from routing_cases import CASES, OBSERVED

    found: dict[Row, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {}
    for family in model_families.FAMILIES:
        found[(family, "tiny")] = partial(_family, family)
    for size in ("tiny", "real"):
        for name, case in {**CASES, **OBSERVED}.items():
            found[(name, size)] = partial(_case, case, size)
    for name, build in PROBES.items():
        found[(name, "tiny")] = partial(_probe, build)
    return found


def _family(family: str) -> tuple[nn.Module, dict[str, Any]]:
    import model_families

    return model_families.build(family), model_families.options(family)


def _case(case: Any, size: str) -> tuple[nn.Module, dict[str, Any]]:
    return case.model(size)[0], {}


def _probe(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, Any]]:
    return build(), {}


def all_warning_counts() -> dict[Row, tuple[int, int]]:
    """The warning table's rows, each family routed (tools/family_table.py)."""
    counts = {}
    for row, make in families_tested().items():
        model, routing = make()
        counts[row] = warning_lines(model, **routing)
    return counts


def logged_counts(text: str) -> tuple[int, int]:
    """:func:`warning_counts` read from the log ``text`` of one ``param_groups`` call."""
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    covered = [re.search(r"\[(\d+) parameters?\]$", line) for line in lines]
    return len(lines), sum(int(found.group(1)) for found in covered if found)


def documented() -> dict[Row, tuple[int, int]]:
    """The rows of docs/routing_warnings.md."""
    from repo_paths import ROOT

    return readme_warnings((ROOT / "docs" / "routing_warnings.md").read_text())
