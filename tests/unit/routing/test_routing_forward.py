"""Every split the routing makes is one the forward makes (issue 36's property test).

For random small configs of the families with fused parameters, each Muon parameter
routed with parts is followed through a real forward (:mod:`forward_provenance`): every
part must be exactly the outputs of some tensor the forward cuts from the parameter's
output, and the axis the forward reads as outputs must be the one the route says (rows
for ``[out, in]``, columns for ``transposed``).

Needs the ``models`` extra (``transformers``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from forward_provenance import Provenance, part_codes
from routing_cases import without_transformers_init
from torch import nn

from muon_dist.routing.param_groups import route_model

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


def _attention(rng: random.Random) -> dict[str, Any]:
    heads = rng.choice([2, 4])
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
    d = rng.choice([4, 8])
    return {
        "vocab_size": 64,
        "hidden_size": heads * d,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": rng.choice([24, 40]),
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _gpt2(rng: random.Random) -> dict[str, Any]:
    heads, d = rng.choice([2, 4]), rng.choice([4, 8])
    return {"vocab_size": 64, "n_embd": heads * d, "n_head": heads, "n_layer": 1}


def _codegen(rng: random.Random) -> dict[str, Any]:
    return {**_gpt2(rng), "n_head": 4, "n_embd": 4 * rng.choice([4, 8]), "rotary_dim": 4}


def _falcon(rng: random.Random) -> dict[str, Any]:
    layout = rng.choice(
        [{"multi_query": True}, {"multi_query": False}, {"new_decoder_architecture": True}]
    )
    base = _attention(rng)
    kv = base["num_key_value_heads"] if layout.get("new_decoder_architecture") else None
    kv = kv or (1 if layout.get("multi_query") else base["num_attention_heads"])
    return {**base, **layout, "num_kv_heads": kv}


def _experts(key: str) -> Callable[[random.Random], dict[str, Any]]:
    def config(rng: random.Random) -> dict[str, Any]:
        return {**_attention(rng), key: 4, "num_experts_per_tok": 2}

    return config


def _jetmoe(rng: random.Random) -> dict[str, Any]:
    base = _attention(rng)
    d = base["hidden_size"] // base["num_attention_heads"]
    return {**base, "kv_channels": d, "num_local_experts": 4, "num_experts_per_tok": 2}


def _gpt_oss(rng: random.Random) -> dict[str, Any]:
    base = _experts("num_local_experts")(rng)
    return {**base, "head_dim": 8, "layer_types": ["full_attention"]}


def _llama4(rng: random.Random) -> dict[str, Any]:
    base = _experts("num_local_experts")(rng)
    hidden = base["hidden_size"]
    return {
        **base,
        "num_experts_per_tok": 1,
        "intermediate_size": rng.choice([hidden // 2, 24]),  # square gate_up included
        "intermediate_size_mlp": 48,
        "moe_layers": [0],
        "no_rope_layers": [1],
    }


def _qwen3_next(rng: random.Random) -> dict[str, Any]:
    base = _experts("num_experts")(rng)
    return {**base, "head_dim": 8, "layer_types": ["full_attention"], "moe_intermediate_size": 12}


def _kimi_linear(rng: random.Random) -> dict[str, Any]:
    base = _experts("num_local_experts")(rng)
    rope = rng.choice([2, 4])
    return {
        **base,
        "num_key_value_heads": base["num_attention_heads"],  # MLA: k, v per query head
        "q_lora_rank": None,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": 2 * rope,  # q_proj's width adds up to q, k, v of rope size
        "v_head_dim": 8,
        "moe_intermediate_size": 12,
        "n_shared_experts": rng.choice([1, 2]),
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],  # the MLA layer (routing_cases has KDA too)
        "mlp_layer_types": ["sparse"],
    }


def _zamba2(rng: random.Random) -> dict[str, Any]:
    heads, d = rng.choice([2, 4]), rng.choice([4, 8])
    return {
        "vocab_size": 64,
        "hidden_size": heads * d,
        "num_attention_heads": heads,
        "intermediate_size": rng.choice([24, 40]),
        "n_mamba_heads": rng.choice([2, 4]),
        "mamba_d_state": 8,
        "chunk_size": 8,
        "use_mamba_kernels": False,
        "num_hidden_layers": 2,
        "layers_block_type": ["hybrid", "hybrid"],
        "num_mem_blocks": rng.choice([1, 2]),
        "use_shared_attention_adapter": rng.choice([True, False]),
        "adapter_rank": 4,
    }


def _xlstm(rng: random.Random) -> dict[str, Any]:
    # hidden 128: the recurrent state is sized from config.qk_dim (rounded up to 64), the
    # layer from int(hidden * qk_dim_factor); the forward runs only where they agree
    return {
        "vocab_size": 64,
        "hidden_size": 128,
        "num_heads": rng.choice([2, 4, 8]),
        "num_hidden_layers": 1,
        "weight_mode": "fused",
        "ffn_proj_factor": rng.choice([1.5, 2.0]),
        "ffn_round_up_to_multiple_of": 8,
    }


FAMILIES: dict[str, tuple[str, str, Callable[[random.Random], dict[str, Any]]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _gpt2),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", _gpt2),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", _codegen),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _attention),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", _attention),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _attention),
    "falcon": ("FalconConfig", "FalconForCausalLM", _falcon),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", _attention),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", _jetmoe),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _experts("num_local_experts")),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _gpt_oss),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", _llama4),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _qwen3_next),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", _kimi_linear),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", _zamba2),
    "xlstm": ("xLSTMConfig", "xLSTMForCausalLM", _xlstm),
}
_BROKEN_INIT = ("xlstm",)  # fused xLSTM's _init_weights raises (transformers 5.23)


def _build(family: str, seed: int) -> nn.Module:
    import transformers as hf

    config_name, model_name, config = FAMILIES[family]
    cfg = getattr(hf, config_name)(**config(random.Random(seed)))
    if family == "gpt_bigcode":
        cfg.multi_query = bool(seed % 2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model_class = getattr(hf, model_name)
    if family in _BROKEN_INIT:
        return without_transformers_init(lambda: model_class(cfg)).eval()
    return model_class(cfg).eval()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_split_is_one_the_forward_makes(family: str, seed: int) -> None:
    model = _build(family, seed)
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(seed))
    problems, splits = [], 0
    for name, (p, route) in route_model(model).items():
        options = dict(route.options)
        if route.algorithm != "muon" or p.ndim < 2:
            continue
        mode = Provenance(p)
        with torch.no_grad(), mode:
            model(input_ids=ids)
        if not mode.applied:
            continue  # not reached by this input (an expert no token chose)
        axis = "columns" if options.get("transposed") else "rows"
        if mode.applied != {axis}:
            problems.append(f"{name}: the forward reads {mode.applied} as outputs, not {axis}")
        if "split_sizes" in options and "num_experts" not in options:
            splits += 1
            rows = p.shape[-1] if options.get("transposed") else p.shape[-2]
            for j, part in enumerate(part_codes(options, rows)):
                if part not in mode.sets:
                    problems.append(f"{name}: part {j} of {options} is no tensor of the forward")
    assert problems == []
    assert splits > 0, "no split to check: the family's fused parameters were not split"
