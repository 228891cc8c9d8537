"""Families whose shapes invite a wrong route (issue 36), at tiny and at their real sizes.

Each case builds a transformers model from a config (the real one from the family's
published config, on the meta device) and says, from its modeling code (transformers
5.23), how its forward reads the parameters a guess would get wrong: ``expected`` maps a
parameter name regex to its Muon view options (``{}``: one whole matrix in ``nn.Linear``
orientation) or to ``"adamw"``. Sizes in the expectations come from the same config
values the model is built from, so a case states layouts, not numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Expected = dict[str, dict[str, Any] | str]


@dataclass(frozen=True)
class Case:
    """One family: ``build(config kwargs)`` and ``expected(config kwargs)``, with tiny and
    real config kwargs."""

    build: Callable[[dict[str, Any]], nn.Module]
    expected: Callable[[dict[str, Any]], Expected]
    tiny: dict[str, Any]
    real: dict[str, Any]

    def model(self, size: str) -> tuple[nn.Module, dict[str, Any]]:
        """The model at ``size`` ("tiny": real tensors, seeded; "real": its published size
        on the meta device) and its config kwargs."""
        kwargs = self.tiny if size == "tiny" else self.real
        torch.manual_seed(0)
        if size == "tiny":
            return self.build(kwargs), kwargs
        with torch.device("meta"):
            return self.build(kwargs), kwargs


def _hf() -> Any:
    import transformers

    return transformers


def _causal(config: str, model: str) -> Callable[[dict[str, Any]], nn.Module]:
    def build(kwargs: dict[str, Any]) -> nn.Module:
        hf = _hf()
        return getattr(hf, model)(getattr(hf, config)(**kwargs))

    return build


_TWO = {"num_hidden_layers": 2}


def without_transformers_init(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with transformers' weight init skipped, then every parameter drawn from
    N(0, 0.02) (nothing to draw on the meta device). For xLSTM with fused weights, whose
    ``_init_weights`` raises in transformers 5.23: it subtracts the whole ``[2 heads]``
    ``ifgate_preact.bias`` from its ``[heads]`` input-gate half."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = make()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def _uninitialized(config: str, model: str) -> Callable[[dict[str, Any]], nn.Module]:
    def build(kwargs: dict[str, Any]) -> nn.Module:
        hf = _hf()
        return without_transformers_init(lambda: getattr(hf, model)(getattr(hf, config)(**kwargs)))

    return build


def _kv_b(c: dict[str, Any]) -> dict[str, Any]:
    """kv_b_proj(x).view(..., heads, nope + v).split([nope, v]): per head k, v."""
    return {
        "split_sizes": (c["qk_nope_head_dim"], c["v_head_dim"]),
        "split_groups": c["num_attention_heads"],
    }


def _latent_kv(c: dict[str, Any]) -> dict[str, Any]:
    """kv_a_proj_with_mqa(x).split([kv_lora_rank, rope]): the latent kv, the rope key."""
    return {"split_sizes": (c["kv_lora_rank"], c["qk_rope_head_dim"])}


def _mla(c: dict[str, Any]) -> Expected:
    """Latent attention: q_proj is per head [nope + rope] of one query (q_lora_rank None,
    split and joined again), kv_a split into the latent kv and the rope key, kv_b per
    head into k and v; shared experts are plain Linears of n_shared * width."""
    whole: dict[str, Any] = {}
    return {
        r"self_attn\.q_proj\.weight$": whole,
        r"self_attn\.kv_a_proj_with_mqa\.weight$": _latent_kv(c),
        r"self_attn\.kv_b_proj\.weight$": _kv_b(c),
        r"shared_experts\.(gate|up)_proj\.weight$": whole,
        r"mlp\.experts\.gate_up_proj$": {
            "experts": True,
            "split_sizes": (c["moe_intermediate_size"],) * 2,
        },
    }


_MLA_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,  # nope = 2 rope: q_proj width = 3 heads of q, k, v of rope size
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "moe_intermediate_size": 12,
    "n_routed_experts": 4,
    "n_shared_experts": 2,  # shared width = 2 expert widths: a "gate + up" by arithmetic
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    **_TWO,
}
_DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite
    **_MLA_TINY,
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
}
_MOONLIGHT = {  # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 architecture)
    **_DEEPSEEK_V2_LITE,
    "vocab_size": 163840,
    "intermediate_size": 11264,
}


def _per_head(c: dict[str, Any], suffix: str, d: int) -> Expected:
    heads = c["num_attention_heads"]
    return {suffix: {"split_sizes": (d, d, d), "split_groups": heads}}


def _minimax(c: dict[str, Any]) -> Expected:
    # qkv.reshape(b, s, heads, 3 * d) then split(d): q, k, v per head
    return {
        **_per_head(c, r"self_attn\.qkv_proj\.weight$", c["head_dim"]),
        r"mlp\.experts\.gate_up_proj$": {
            "experts": True,
            "split_sizes": (c["intermediate_size"],) * 2,
        },
    }


def _persimmon(c: dict[str, Any]) -> Expected:
    # view(b, s, heads, 3, d)
    d = c["hidden_size"] // c["num_attention_heads"]
    return _per_head(c, r"self_attn\.query_key_value\.weight$", d)


def _codegen(c: dict[str, Any]) -> Expected:
    # reshape(..., mp_num=4, -1) then split(local_dim): q, v, k in each of 4 partitions
    local = c["n_embd"] // 4
    return {r"attn\.qkv_proj\.weight$": {"split_sizes": (local,) * 3, "split_groups": 4}}


def _jetmoe(c: dict[str, Any]) -> Expected:
    kv = c["kv_channels"] * c["num_key_value_heads"]
    return {
        r"self_attention\.kv_proj\.weight$": {"split_sizes": (kv, kv)},  # chunk(2): k, v
        r"self_attention\.experts\.router\.layer\.weight$": {},
        r"self_attention\.experts\.input_linear\.weight$": {"experts": True},
        r"mlp\.input_linear\.weight$": {
            "experts": True,
            "split_sizes": (c["intermediate_size"],) * 2,
        },
        r"mlp\.router\.layer\.weight$": {},
    }


def _expert_modules(prefix: str) -> Callable[[dict[str, Any]], Expected]:
    """Experts as a ModuleDict of expert_{i} MLPs of nn.Linear: each weight one matrix."""

    def expected(c: dict[str, Any]) -> Expected:
        return {prefix + r"\.expert_\d+\.\w+\.weight$": {}, r"router\.classifier\.weight$": {}}

    return expected


def _gpt_oss(c: dict[str, Any]) -> Expected:
    # x @ W[e] ([E, H, 2I]) then gate_up[..., ::2], [..., 1::2]; x @ down[e] ([E, I, H])
    return {
        r"experts\.gate_up_proj$": {
            "experts": True,
            "transposed": True,
            "split_sizes": (1, 1),
            "split_groups": c["intermediate_size"],
        },
        r"experts\.down_proj$": {"experts": True, "transposed": True},
    }


def _llama4(c: dict[str, Any]) -> Expected:
    # bmm(x, gate_up [E, H, 2I]).chunk(2); bmm(h, down [E, I, H])
    return {
        r"experts\.gate_up_proj$": {
            "experts": True,
            "transposed": True,
            "split_sizes": (c["intermediate_size"],) * 2,
        },
        r"experts\.down_proj$": {"experts": True, "transposed": True},
    }


def _mistral4(c: dict[str, Any]) -> Expected:
    return {
        r"experts\.gate_up_proj$": {
            "experts": True,
            "split_sizes": (c["moe_intermediate_size"],) * 2,
        },
        r"experts\.down_proj$": {"experts": True},
        r"self_attn\.q_b_proj\.weight$": {},
        r"self_attn\.kv_a_proj_with_mqa\.weight$": _latent_kv(c),
        r"self_attn\.kv_b_proj\.weight$": _kv_b(c),
    }


def _gemma3_vlm(c: dict[str, Any]) -> Expected:
    # torch.matmul(vision, mm_input_projection_weight [vision_hidden, text_hidden]); the
    # vision pooling head's nn.MultiheadAttention: q, k, v blocks
    vision = c["vision_config"]["hidden_size"]
    return {
        r"mm_input_projection_weight$": {"transposed": True},
        r"head\.attention\.in_proj_weight$": {"split_sizes": (vision,) * 3},
    }


def _qwen3_5(c: dict[str, Any]) -> Expected:
    d = c["head_dim"]
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return {
        # view(..., -1, 2 d).chunk(2): q and gate per head
        r"self_attn\.q_proj\.weight$": {
            "split_sizes": (d, d),
            "split_groups": c["num_attention_heads"],
        },
        r"linear_attn\.in_proj_qkv\.weight$": {"split_sizes": (key, key, value)},
        r"linear_attn\.in_proj_[zba]\.weight$": {},
    }


def _shared_experts(c: dict[str, Any]) -> Expected:
    return {r"shared_experts\.(gate|up)_proj\.weight$": {}}


def _rwkv(c: dict[str, Any]) -> Expected:
    return {
        r"attention\.output\.weight$": {},  # a hidden layer named output
        r"^head\.weight$": "adamw",  # the head, by get_output_embeddings()
        r"time_mix_\w+$": "adamw",
    }


def _score(c: dict[str, Any]) -> Expected:
    return {r"^score\.weight$": "adamw"}


def _bert_mlm(c: dict[str, Any]) -> Expected:
    return {r"predictions\.decoder\.weight$": "adamw", r"transform\.dense\.weight$": {}}


def _sam(c: dict[str, Any]) -> Expected:
    # qkv.reshape(b, hw, 3, heads, -1): q, k, v thirds
    hidden = c["vision_config"]["hidden_size"]
    return {
        r"attn\.rel_pos_[hw]$": "adamw",
        r"vision_encoder\.pos_embed$": "adamw",
        r"vision_encoder\.layers\.\d+\.attn\.qkv\.weight$": {"split_sizes": (hidden,) * 3},
    }


def _wav2vec2(c: dict[str, Any]) -> Expected:
    return {r"pos_conv_embed\.conv\.parametrizations\.weight\.original\d$": "adamw"}


def _zamba2(c: dict[str, Any]) -> Expected:
    # Zamba2MLP: (gate_up_proj(x) + gate_up_proj_adapter_list[i](x)).chunk(2): the
    # adapter's second Linear writes the same gate and up halves; q, k, v adapters and the
    # adapters' first Linear (to adapter_rank) are one map each
    halves = {"split_sizes": (c["intermediate_size"],) * 2}
    # the mamba mixer: in_proj(x).split([I, I + 2 G N, H]), then x, B, C after the conv
    inner = c.get("mamba_expand", 2) * c["hidden_size"]
    bc = c.get("mamba_ngroups", 1) * c["mamba_d_state"]
    return {
        r"mamba\.in_proj\.weight$": {"split_sizes": (inner, inner, bc, bc, c["n_mamba_heads"])},
        r"feed_forward\.gate_up_proj\.weight$": halves,
        r"feed_forward\.gate_up_proj_adapter_list\.\d+\.1\.weight$": halves,
        r"adapter_list\.\d+\.0\.weight$": {},
        r"self_attn\.linear_[qkv]_adapter_list\.\d+\.1\.weight$": {},
    }


def _xlstm_dims(c: dict[str, Any]) -> tuple[int, int, int]:
    """xLSTMLayer's qk_dim, v_dim and xLSTMFeedForward's up_proj_dim."""
    h, multiple = c["hidden_size"], c["ffn_round_up_to_multiple_of"]
    up = -(-h * c["ffn_proj_factor"] // multiple) * multiple  # round_up_to_next_multiple_of
    return int(h * c["qk_dim_factor"]), int(h * c["v_dim_factor"]), int(up)


def _xlstm_fused(c: dict[str, Any]) -> Expected:
    # tensor_split(qkv_opreact(x), (qk, 2 qk, 2 qk + v)): q, k, v, o; tensor_split(
    # ifgate_preact(x), (heads,)): i, f; tensor_split(proj_up_gate_z(x), (up,)): gate, z
    qk, v, up = _xlstm_dims(c)
    return {
        r"mlstm_layer\.qkv_opreact\.weight$": {"split_sizes": (qk, qk, v, v)},
        r"mlstm_layer\.ifgate_preact\.weight$": {"split_sizes": (c["num_heads"],) * 2},
        r"ffn\.proj_up_gate_z\.weight$": {"split_sizes": (up, up)},
        r"mlstm_layer\.out_proj\.weight$": {},
    }


def _xlstm_single(c: dict[str, Any]) -> Expected:
    # act(proj_up_gate(x)) * proj_up(x): one map each, whatever their names suggest
    return {r"ffn\.proj_up(_gate)?\.weight$": {}, r"mlstm_layer\.[qkv]\.weight$": {}}


def _deformable_detr(c: dict[str, Any]) -> Expected:
    # level_embed[level] is added to each level's position embedding (a table); per
    # decoder layer, class_embed[i] and bbox_embed[i] (3-layer MLP, its last Linear the
    # box head) read the hidden states (with box refinement, inside the decoder)
    return {
        r"model\.level_embed$": "adamw",
        r"class_embed\.\d+\.weight$": "adamw",
        r"bbox_embed\.\d+\.layers\.2\.weight$": "adamw",
        r"bbox_embed\.\d+\.layers\.[01]\.weight$": {},
    }


_SWITCH_TINY = {
    "vocab_size": 64,
    "d_model": 32,
    "d_ff": 48,
    "d_kv": 8,
    "num_heads": 4,
    "num_experts": 4,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_sparse_encoder_layers": 1,
    "num_sparse_decoder_layers": 1,
}
_NLLB_TINY = {
    "vocab_size": 64,
    "d_model": 32,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "num_experts": 4,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_sparse_step": 2,
    "decoder_sparse_step": 2,
    "max_position_embeddings": 64,
}
_GEMMA3_VLM_TINY = {
    "text_config": {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    },
    "vision_config": {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    },
    "mm_tokens_per_image": 4,
}
_SAM_TINY = {
    "vision_config": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "image_size": 64,
        "patch_size": 16,
        "output_channels": 16,
        "window_size": 2,
        "global_attn_indexes": [0],
        "mlp_dim": 48,
        "num_pos_feats": 8,  # the shared positional embedding: 2 * 8 = the decoder's 16
    },
    "prompt_encoder_config": {"hidden_size": 16, "image_size": 64, "patch_size": 16},
    "mask_decoder_config": {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "mlp_dim": 24,
        "iou_head_hidden_dim": 16,
    },
}
_QWEN3_5_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    **_TWO,
}

_DEEPSEEK_ONLY = ("n_routed_experts", "first_k_dense_replace")
_KIMI_LINEAR_TINY = {  # MLA layer (q_lora_rank None, nope = 2 rope) after a KDA layer
    **{k: v for k, v in _MLA_TINY.items() if k not in _DEEPSEEK_ONLY},
    "num_local_experts": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse"],
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_KIMI_LINEAR_48B = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct, 2 layers
    **_KIMI_LINEAR_TINY,
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_local_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "linear_num_heads": 32,
    "linear_head_dim": 128,
}
_ZAMBA2_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "n_mamba_heads": 4,
    "mamba_d_state": 8,
    "layers_block_type": ["mamba", "hybrid", "hybrid"],
    "num_hidden_layers": 3,  # must equal len(layers_block_type)
    "num_mem_blocks": 2,  # two shared blocks: each hybrid layer's adapter or an Identity
    "use_shared_attention_adapter": True,
    "adapter_rank": 4,
    "use_mamba_kernels": False,
}
_XLSTM_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_heads": 4,
    "qk_dim_factor": 0.5,
    "v_dim_factor": 1.0,
    "ffn_proj_factor": 2.667,
    "ffn_round_up_to_multiple_of": 64,
    **_TWO,
}
_XLSTM_7B = _XLSTM_TINY | {"vocab_size": 50304, "hidden_size": 4096, "num_heads": 8}
_DETR_BACKBONE_TINY = {
    "model_type": "resnet",
    "embedding_size": 8,
    "hidden_sizes": [8, 8, 8, 8],
    "depths": [1, 1, 1, 1],
    "layer_type": "basic",
    "out_features": ["stage2", "stage3", "stage4"],
}
_DEFORMABLE_DETR_TINY = {
    "backbone_config": _DETR_BACKBONE_TINY,
    "num_feature_levels": 4,  # 3 backbone levels, one more by a strided conv (4 >= the
    # smallest Muon side: level_embed is AdamW by the family table, not by its size)
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 2,  # one decoder layer fails: no class_embed.1 to tie to class_embed.0
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "encoder_n_points": 2,
    "decoder_n_points": 2,
    "num_queries": 10,
    "num_labels": 5,
}
_DEFORMABLE_DETR = {  # SenseTime/deformable-detr: ResNet-50 (built here as ResNetConfig)
    "backbone_config": {"model_type": "resnet", "out_features": ["stage2", "stage3", "stage4"]},
    "num_labels": 91,
}
_TWO_STAGE = {"with_box_refine": True, "two_stage": True}


def _llama4_case(tiny_intermediate: int, real_intermediate: int) -> Case:
    """Llama 4 text models at tiny and Scout's published sizes, but for the experts' width."""
    rest = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}
    layers = {"moe_layers": [1], "no_rope_layers": [1, 1]} | _TWO
    return Case(
        _causal("Llama4TextConfig", "Llama4ForCausalLM"),
        _llama4,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": tiny_intermediate}
        | {"head_dim": 8, "intermediate_size_mlp": 64}
        | rest
        | layers,
        {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": real_intermediate}
        | {"head_dim": 128, "intermediate_size_mlp": 16384, "num_attention_heads": 40}
        | {"num_key_value_heads": 8, "num_local_experts": 16}
        | layers,
    )


CASES: dict[str, Case] = {
    "deepseek_v2_lite": Case(
        _causal("DeepseekV2Config", "DeepseekV2ForCausalLM"), _mla, _MLA_TINY, _DEEPSEEK_V2_LITE
    ),
    "moonlight": Case(
        _causal("DeepseekV3Config", "DeepseekV3ForCausalLM"), _mla, _MLA_TINY, _MOONLIGHT
    ),
    "ernie4_5_moe": Case(  # baidu/ERNIE-4.5-21B-A3B: two shared experts
        _causal("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
        _shared_experts,
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "moe_intermediate_size": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "moe_num_experts": 4,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_k": 2,
            **_TWO,
        },
        {
            "vocab_size": 103424,
            "hidden_size": 2560,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_attention_heads": 20,
            "num_key_value_heads": 4,
            "moe_num_experts": 64,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_k": 6,
            **_TWO,
        },
    ),
    "minimax": Case(  # MiniMaxAI/MiniMax-Text-01
        _causal("MiniMaxConfig", "MiniMaxForCausalLM"),
        _minimax,
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_local_experts": 4,
            "layer_types": ["linear_attention", "full_attention"],
            **_TWO,
        },
        {
            "vocab_size": 200064,
            "hidden_size": 6144,
            "intermediate_size": 9216,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 32,
            "layer_types": ["linear_attention", "full_attention"],
            **_TWO,
        },
    ),
    "persimmon": Case(  # adept/persimmon-8b-base
        _causal("PersimmonConfig", "PersimmonForCausalLM"),
        _persimmon,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}
        | _TWO,
        {"vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384}
        | {"num_attention_heads": 64}
        | _TWO,
    ),
    "codegen": Case(  # Salesforce/codegen-2B-mono
        _causal("CodeGenConfig", "CodeGenForCausalLM"),
        _codegen,
        {"vocab_size": 64, "n_embd": 32, "n_head": 4, "rotary_dim": 4, "n_layer": 2},
        {"vocab_size": 51200, "n_embd": 2560, "n_head": 32, "rotary_dim": 64, "n_layer": 2},
    ),
    "jetmoe": Case(  # jetmoe/jetmoe-8b
        _causal("JetMoeConfig", "JetMoeForCausalLM"),
        _jetmoe,
        {"vocab_size": 64, "hidden_size": 32, "kv_channels": 8, "num_key_value_heads": 2}
        | {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}
        | _TWO,
        {"vocab_size": 32000, "hidden_size": 2048, "kv_channels": 128}
        | {"num_key_value_heads": 16, "num_local_experts": 8, "num_experts_per_tok": 2}
        | {"intermediate_size": 5632}
        | _TWO,
    ),
    "switch": Case(  # google/switch-base-8
        _causal("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration"),
        _expert_modules(r"mlp\.experts"),
        _SWITCH_TINY,
        _SWITCH_TINY
        | {"vocab_size": 32128, "d_model": 768, "d_ff": 3072, "d_kv": 64, "num_heads": 12}
        | {"num_experts": 8},
    ),
    "nllb_moe": Case(  # facebook/nllb-moe-54b
        _causal("NllbMoeConfig", "NllbMoeForConditionalGeneration"),
        _expert_modules(r"ffn\.experts"),
        _NLLB_TINY,
        _NLLB_TINY
        | {"vocab_size": 256206, "d_model": 2048, "encoder_ffn_dim": 8192}
        | {"decoder_ffn_dim": 8192, "num_experts": 128, "encoder_attention_heads": 16}
        | {"decoder_attention_heads": 16, "max_position_embeddings": 1024},
    ),
    "gpt_oss_20b": Case(  # openai/gpt-oss-20b: hidden = intermediate = 2880
        _causal("GptOssConfig", "GptOssForCausalLM"),
        _gpt_oss,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "head_dim": 8}
        | {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}
        | {"layer_types": ["sliding_attention", "full_attention"]}
        | _TWO,
        {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64}
        | {"num_attention_heads": 64, "num_key_value_heads": 8, "num_local_experts": 32}
        | {"layer_types": ["sliding_attention", "full_attention"]}
        | _TWO,
    ),
    # 2 * intermediate = hidden: the shapes cannot tell
    "llama4_square": _llama4_case(tiny_intermediate=16, real_intermediate=2560),
    # meta-llama/Llama-4-Scout-17B-16E
    "llama4_scout": _llama4_case(tiny_intermediate=48, real_intermediate=8192),
    "mistral_small_4": Case(  # 2 * moe_intermediate = hidden
        _causal("Mistral4Config", "Mistral4ForCausalLM"),
        _mistral4,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48}
        | {"moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4}
        | {"n_routed_experts": 4, "n_shared_experts": 1, "q_lora_rank": 16, "kv_lora_rank": 8}
        | {"qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "head_dim": 4}
        | {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}
        | {"num_experts_per_tok": 2, "num_hidden_layers": 1},
        {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288}
        | {"moe_intermediate_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 32}
        | {"n_routed_experts": 128, "n_shared_experts": 1, "q_lora_rank": 1024}
        | {"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64}
        | {"v_head_dim": 128, "head_dim": 64, "first_k_dense_replace": 0, "n_group": 1}
        | {"topk_group": 1, "num_experts_per_tok": 4, "num_hidden_layers": 1},
    ),
    "gemma3_vlm": Case(  # google/gemma-3-4b-it
        _causal("Gemma3Config", "Gemma3ForConditionalGeneration"),
        _gemma3_vlm,
        _GEMMA3_VLM_TINY,
        {
            "text_config": _GEMMA3_VLM_TINY["text_config"]
            | {"vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240}
            | {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
            "vision_config": _GEMMA3_VLM_TINY["vision_config"]
            | {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16}
            | {"image_size": 896, "patch_size": 14},
            "mm_tokens_per_image": 256,
        },
    ),
    "qwen3_5": Case(  # Qwen3.5's hybrid attention at Qwen3-Next-80B-A3B's sizes
        _causal("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        _qwen3_5,
        _QWEN3_5_TINY,
        _QWEN3_5_TINY
        | {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120}
        | {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256}
        | {"linear_num_key_heads": 16, "linear_num_value_heads": 32}
        | {"linear_key_head_dim": 128, "linear_value_head_dim": 128},
    ),
    "rwkv": Case(  # RWKV/rwkv-4-169m-pile
        _causal("RwkvConfig", "RwkvForCausalLM"),
        _rwkv,
        {"vocab_size": 64, "hidden_size": 32, "attention_hidden_size": 32}
        | {"intermediate_size": 48, "num_hidden_layers": 2},
        {"vocab_size": 50277, "hidden_size": 768, "attention_hidden_size": 768}
        | {"intermediate_size": 3072, "num_hidden_layers": 2},
    ),
    "llama_score": Case(  # sequence classification with 5 labels
        _causal("LlamaConfig", "LlamaForSequenceClassification"),
        _score,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_labels": 5}
        | {"num_attention_heads": 4, "pad_token_id": 0}
        | _TWO,
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_labels": 5}
        | {"num_attention_heads": 32, "pad_token_id": 0}
        | _TWO,
    ),
    "bert_mlm_untied": Case(
        _causal("BertConfig", "BertForMaskedLM"),
        _bert_mlm,
        {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48}
        | {"num_attention_heads": 4, "tie_word_embeddings": False}
        | _TWO,
        {"vocab_size": 30522, "hidden_size": 768, "intermediate_size": 3072}
        | {"num_attention_heads": 12, "tie_word_embeddings": False}
        | _TWO,
    ),
    "sam": Case(  # facebook/sam-vit-base
        _causal("SamConfig", "SamModel"),
        _sam,
        _SAM_TINY,
        {
            **_SAM_TINY,
            "vision_config": _SAM_TINY["vision_config"]
            | {"hidden_size": 768, "num_attention_heads": 12, "image_size": 1024}
            | {"output_channels": 256, "window_size": 14, "mlp_dim": 3072}
            | {"num_pos_feats": 128},
            "prompt_encoder_config": {},  # the published sizes: 256 wide, 1024 pixels
            "mask_decoder_config": {},
        },
    ),
    "wav2vec2": Case(  # facebook/wav2vec2-base: a weight-norm positional convolution
        _causal("Wav2Vec2Config", "Wav2Vec2ForCTC"),
        _wav2vec2,
        {"vocab_size": 16, "hidden_size": 32, "num_hidden_layers": 1}
        | {"num_attention_heads": 4, "intermediate_size": 48, "conv_dim": [8, 8]}
        | {"conv_stride": [2, 2], "conv_kernel": [3, 3], "num_conv_pos_embeddings": 8}
        | {"num_conv_pos_embedding_groups": 4},
        {"vocab_size": 32, "hidden_size": 768, "num_hidden_layers": 1}
        | {"num_attention_heads": 12, "intermediate_size": 3072}
        | {"num_conv_pos_embeddings": 128, "num_conv_pos_embedding_groups": 16},
    ),
    "kimi_linear": Case(
        _causal("KimiLinearConfig", "KimiLinearForCausalLM"),
        _mla,
        _KIMI_LINEAR_TINY,
        _KIMI_LINEAR_48B,
    ),
    "zamba2": Case(  # Zyphra/Zamba2-2.7B's widths, 3 layers, attention adapters on
        _causal("Zamba2Config", "Zamba2ForCausalLM"),
        _zamba2,
        _ZAMBA2_TINY,
        _ZAMBA2_TINY
        | {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 10240}
        | {"num_attention_heads": 32, "n_mamba_heads": 80, "mamba_d_state": 64}
        | {"adapter_rank": 128},
    ),
    "xlstm_fused": Case(  # NX-AI/xLSTM-7b's sizes, weight_mode="fused"
        _uninitialized("xLSTMConfig", "xLSTMForCausalLM"),
        _xlstm_fused,
        _XLSTM_TINY | {"weight_mode": "fused"},
        _XLSTM_7B | {"weight_mode": "fused"},
    ),
    "xlstm_single": Case(
        _causal("xLSTMConfig", "xLSTMForCausalLM"), _xlstm_single, _XLSTM_TINY, _XLSTM_7B
    ),
    "deformable_detr": Case(
        _causal("DeformableDetrConfig", "DeformableDetrForObjectDetection"),
        _deformable_detr,
        _DEFORMABLE_DETR_TINY,
        _DEFORMABLE_DETR,
    ),
    "deformable_detr_two_stage": Case(  # SenseTime/deformable-detr-with-box-refine-two-stage
        _causal("DeformableDetrConfig", "DeformableDetrForObjectDetection"),
        _deformable_detr,
        _DEFORMABLE_DETR_TINY | _TWO_STAGE,
        _DEFORMABLE_DETR | _TWO_STAGE,
    ),
}


# ---------------------------------------------------------------------------------------
# Issue 46: families no class rule names, settled by observing their forward on meta


def _mamba2_copy(prefix: str, heads: str, head_dim: str, state: str, groups: str) -> Any:
    """Mamba2 mixers under new class names: in_proj(x).split([I, conv, H]) into z, xBC,
    dt; after the depthwise conv, xBC.split([I, G N, G N]) into x, B, C."""

    def expected(c: dict[str, Any]) -> Expected:
        inner = c[heads] * c[head_dim]
        bc = c[groups] * c[state]
        return {prefix + r"\.in_proj\.weight$": {"split_sizes": (inner, inner, bc, bc, c[heads])}}

    return expected


def _gate_up(pattern: str, width: str) -> Any:
    def expected(c: dict[str, Any]) -> Expected:  # gate_up(x).chunk(2): gate, up
        return {pattern: {"split_sizes": (c[width],) * 2}}

    return expected


def _mpt(c: dict[str, Any]) -> Expected:  # Wqkv(x).chunk(3, dim=2): q, k, v
    return {r"attn\.Wqkv\.weight$": {"split_sizes": (c["d_model"],) * 3}}


def _lfm2(c: dict[str, Any]) -> Expected:  # in_proj(x).transpose.chunk(3, dim=-2): B, C, x
    return {r"conv\.in_proj\.weight$": {"split_sizes": (c["hidden_size"],) * 3}}


_HYBRID_TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "pad_token_id": 0}
_HYBRID_TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
_BAMBA_TINY = _HYBRID_TINY | {"attn_layer_indices": [1], "mamba_n_heads": 4}
_BAMBA_TINY |= {"mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_expand": 2}
_NEMOTRON_H_TINY = _HYBRID_TINY | {"hybrid_override_pattern": "M*", "mamba_num_heads": 4}
_NEMOTRON_H_TINY |= {"mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2, "expand": 2}
_GRANITE_H_TINY = _HYBRID_TINY | {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4}
_GRANITE_H_TINY |= {"mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1}
_GRANITE_H_TINY |= {"num_local_experts": 4, "num_experts_per_tok": 2, "mamba_expand": 2}
_GRANITE_H_TINY |= {"shared_intermediate_size": 48}
_PUBLISHED_HYBRID = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336}
_PUBLISHED_HYBRID |= {"num_attention_heads": 32, "num_key_value_heads": 8}

OBSERVED: dict[str, Case] = {
    "bamba": Case(  # ibm-ai-platform/Bamba-9B
        _causal("BambaConfig", "BambaForCausalLM"),
        _mamba2_copy(r"mamba", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups"),
        _BAMBA_TINY,
        _BAMBA_TINY
        | _PUBLISHED_HYBRID
        | {"mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128},
    ),
    "nemotron_h": Case(  # nvidia/Nemotron-H-8B-Base-8K
        _causal("NemotronHConfig", "NemotronHForCausalLM"),
        _mamba2_copy(r"mixer", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups"),
        _NEMOTRON_H_TINY,
        _NEMOTRON_H_TINY
        | _PUBLISHED_HYBRID
        | {"vocab_size": 131072, "intermediate_size": 21504, "mamba_num_heads": 128}
        | {"mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8},
    ),
    "granitemoehybrid": Case(  # ibm-granite/granite-4.0-h-tiny
        _causal("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
        _mamba2_copy(r"mamba", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups"),
        _GRANITE_H_TINY,
        _GRANITE_H_TINY
        | {"vocab_size": 100352, "hidden_size": 1536, "intermediate_size": 512}
        | {"num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48}
        | {"mamba_d_head": 64, "mamba_d_state": 128, "num_local_experts": 64}
        | {"num_experts_per_tok": 6, "shared_intermediate_size": 1024},
    ),
    "glm4": Case(  # THUDM/GLM-4-9B-0414
        _causal("Glm4Config", "Glm4ForCausalLM"),
        _gate_up(r"mlp\.gate_up_proj\.weight$", "intermediate_size"),
        _HYBRID_TINY,
        _HYBRID_TINY
        | {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696}
        | {"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128},
    ),
    "mpt": Case(  # mosaicml/mpt-7b
        _causal("MptConfig", "MptForCausalLM"),
        _mpt,
        {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2},
        {"vocab_size": 50432, "d_model": 4096, "n_heads": 32, "n_layers": 2},
    ),
    "lfm2": Case(  # LiquidAI/LFM2-1.2B
        _causal("Lfm2Config", "Lfm2ForCausalLM"),
        _lfm2,
        _HYBRID_TINY | {"layer_types": ["conv", "full_attention"]},
        _HYBRID_TINY
        | {"layer_types": ["conv", "full_attention"], "vocab_size": 65536}
        | {"hidden_size": 2048, "intermediate_size": 12288, "num_attention_heads": 32}
        | {"num_key_value_heads": 8},
    ),
}

# Tiny configs with runs of three or more layers of one kind (repeated blocks).
_SLIDING = "sliding_attention"
DEEP: dict[str, tuple[Callable[[dict[str, Any]], nn.Module], dict[str, Any]]] = {
    "llama": (_causal("LlamaConfig", "LlamaForCausalLM"), _HYBRID_TINY | {"num_hidden_layers": 4}),
    "bamba": (
        OBSERVED["bamba"].build,
        _BAMBA_TINY | {"num_hidden_layers": 5, "attn_layer_indices": [2]},
    ),
    "lfm2": (
        OBSERVED["lfm2"].build,
        OBSERVED["lfm2"].tiny
        | {"num_hidden_layers": 4, "layer_types": ["conv", "conv", "conv", "full_attention"]},
    ),
    "mpt": (OBSERVED["mpt"].build, OBSERVED["mpt"].tiny | {"n_layers": 4}),
    # An encoder, Conv1D weights, twins apart (a full-attention layer between sliding
    # ones), experts (observed in eval mode): untraced layers answered for all the same.
    "bert": (
        CASES["bert_mlm_untied"].build,
        CASES["bert_mlm_untied"].tiny | {"num_hidden_layers": 4},
    ),
    "gpt2": (
        _causal("GPT2Config", "GPT2LMHeadModel"),
        {"vocab_size": 64, "n_embd": 32, "n_head": 4, "n_layer": 4},
    ),
    "gemma3": (
        _causal("Gemma3TextConfig", "Gemma3ForCausalLM"),
        _HYBRID_TINY
        | {"num_hidden_layers": 5, "head_dim": 8, "sliding_window": 4}
        | {"layer_types": [_SLIDING, _SLIDING, "full_attention", _SLIDING, _SLIDING]},
    ),
    "mixtral": (
        _causal("MixtralConfig", "MixtralForCausalLM"),
        _HYBRID_TINY | {"num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}


def _aya(c: dict[str, Any]) -> Expected:  # x, gate = linear_1(x).chunk(2, dim=-1)
    half = c["alignment_intermediate_size"] // 2
    return {r"multi_modal_projector\.linear_1\.weight$": {"split_sizes": (half, half)}}


_AYA_TINY = {
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32}
    | {"intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4}
    | {"image_size": 32, "patch_size": 8},
    "text_config": {"model_type": "cohere2", "vocab_size": 64, "hidden_size": 32}
    | {"intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4}
    | {"num_key_value_heads": 2, "pad_token_id": 0},
    "alignment_intermediate_size": 64,
    "downsample_factor": 2,
    "image_token_index": 5,
}
OBSERVED["aya_vision"] = Case(  # CohereForAI/aya-vision-8b, one layer per tower
    _causal("AyaVisionConfig", "AyaVisionForConditionalGeneration"),
    _aya,
    _AYA_TINY,
    _AYA_TINY
    | {
        "vision_config": _AYA_TINY["vision_config"]
        | {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16}
        | {"image_size": 364, "patch_size": 14},
        "text_config": _AYA_TINY["text_config"]
        | {"vocab_size": 256000, "hidden_size": 4096, "intermediate_size": 14336}
        | {"num_attention_heads": 32, "num_key_value_heads": 8},
        "alignment_intermediate_size": 28672,
        "image_token_index": 255036,
    },
)
