"""Real model families from tiny configs, and what param_groups must make of them.

Each family is built by the installed ``transformers`` from a small config. Shapes are
chosen so that a wrong routing shows: fused gate+up matrices have more outputs than inputs
(orthogonalizing them whole leaves each part's singular values well below 1), and GPT-OSS's
``[in, out]`` down projection has more outputs than inputs (its lr scale is not 1).
``EXPECTED`` is each family's whole routing table (rows inside layers keyed by their name
within the layer), written from its modeling code (transformers 5.23): matrix view, and
the lr scale of every part. ``true_layout`` says how each forward reads its fused and
``[in, out]`` parameters, for the per-block check of the first update.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import muon_dist
from muon_dist.kernels import newton_schulz

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 32, 4, 2, 8, 4
COMMON = {
    "vocab_size": 64,
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 64,
    "head_dim": HEAD_DIM,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


_TOKENS = {k: COMMON[k] for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
# Families whose configs name their dimensions differently: only the token ids are shared.
_OWN_DIMENSIONS = ("gpt2", "gpt_bigcode", "dbrx")
_GPT2 = {"n_embd": HIDDEN, "n_layer": 2, "n_head": HEADS, "n_positions": 64}
_SHARED_MOE = {
    "num_experts": EXPERTS,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 48,
}


def _configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    import transformers as hf

    moe = {"num_experts_per_tok": 2}
    return {
        "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, {}),
        "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, {}),
        "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, {}),
        "qwen3_moe": (
            hf.Qwen3MoeConfig,
            hf.Qwen3MoeForCausalLM,
            {**moe, "num_experts": EXPERTS, "moe_intermediate_size": 24},
        ),
        "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM, {**moe, "num_local_experts": 4}),
        "deepseek_v3": (
            hf.DeepseekV3Config,
            hf.DeepseekV3ForCausalLM,
            {
                **moe,
                "n_routed_experts": EXPERTS,
                "n_shared_experts": 1,
                "moe_intermediate_size": 24,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "q_lora_rank": 16,
                "kv_lora_rank": 8,
                "qk_rope_head_dim": 4,
                "qk_nope_head_dim": 4,
                "v_head_dim": 8,
                "head_dim": 4,  # the rotary part, as DeepseekV3Config derives it
            },
        ),
        "gpt_oss": (
            hf.GptOssConfig,
            hf.GptOssForCausalLM,
            {
                **moe,
                "num_local_experts": EXPERTS,
                "intermediate_size": 24,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
        "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, {}),
        "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM, {}),
        "gemma3": (hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, {}),
        "llama4": (
            hf.Llama4TextConfig,
            hf.Llama4ForCausalLM,
            {
                "intermediate_size_mlp": 48,
                "num_local_experts": EXPERTS,
                "num_experts_per_tok": 1,
                "moe_layers": [1],
                "no_rope_layers": [1, 1],
            },
        ),
        "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, _GPT2),
        "gpt_neox": (hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, {}),
        "gpt_bigcode": (
            hf.GPTBigCodeConfig,
            hf.GPTBigCodeForCausalLM,
            {**_GPT2, "multi_query": True},
        ),
        "dbrx": (
            hf.DbrxConfig,
            hf.DbrxForCausalLM,
            {
                "d_model": HIDDEN,
                "n_layers": 2,
                "n_heads": HEADS,
                "max_seq_len": 64,
                "attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0},
                "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": EXPERTS, "moe_top_k": 2},
            },
        ),
        "qwen2_moe": (
            hf.Qwen2MoeConfig,
            hf.Qwen2MoeForCausalLM,
            {**moe, **_SHARED_MOE},
        ),
        "qwen3_next": (
            hf.Qwen3NextConfig,
            hf.Qwen3NextForCausalLM,
            {
                **moe,
                **_SHARED_MOE,
                "layer_types": ["linear_attention", "full_attention"],
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
            },
        ),
        "mamba2": (
            hf.Mamba2Config,
            hf.Mamba2ForCausalLM,
            {"num_heads": 8, "head_dim": 8, "state_size": 16, "n_groups": 1, "expand": 2},
        ),
        "jamba": (
            hf.JambaConfig,
            hf.JambaForCausalLM,
            {
                **moe,
                "num_experts": EXPERTS,
                "attn_layer_period": 2,
                "attn_layer_offset": 1,
                "expert_layer_period": 2,
                "expert_layer_offset": 1,
                "mamba_d_state": 8,
                "mamba_dt_rank": 8,
                "use_mamba_kernels": False,
            },
        ),
        "vit": (
            hf.ViTConfig,
            hf.ViTForImageClassification,
            {"image_size": 16, "patch_size": 4, "num_labels": 3},
        ),
        "whisper": (
            hf.WhisperConfig,
            hf.WhisperForConditionalGeneration,
            {
                "d_model": HIDDEN,
                "encoder_layers": 1,
                "decoder_layers": 1,
                "encoder_attention_heads": HEADS,
                "decoder_attention_heads": HEADS,
                "encoder_ffn_dim": 48,
                "decoder_ffn_dim": 48,
                "num_mel_bins": 8,
                "max_source_positions": 16,
                "decoder_start_token_id": 1,
            },
        ),
        "modernbert": (hf.ModernBertConfig, hf.ModernBertForMaskedLM, {}),
        "gemma3n": (
            hf.Gemma3nTextConfig,
            hf.Gemma3nForCausalLM,
            {
                "vocab_size_per_layer_input": 64,
                "hidden_size_per_layer_input": 8,
                "layer_types": ["sliding_attention", "full_attention"],
                "num_kv_shared_layers": 0,
                "activation_sparsity_pattern": [0.0, 0.0],
                "altup_num_inputs": 2,
                "laurel_rank": 8,
            },
        ),
    }


FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "phi3",
    "gemma",
    "gemma3",
    "llama4",
    "gpt2",
    "gpt_neox",
    "gpt_bigcode",
    "dbrx",
    "qwen2_moe",
    "qwen3_next",
    "mamba2",
    "jamba",
    "vit",
    "whisper",
    "modernbert",
    "gemma3n",
)


def build(family: str) -> nn.Module:
    """The family's causal LM from its tiny config, with the same weights on every rank."""
    config_cls, model_cls, extra = _configs()[family]
    torch.manual_seed(0)
    base = _TOKENS if family in _OWN_DIMENSIONS else COMMON
    model = model_cls(config_cls(**{**base, **extra}))
    model.config.use_cache = False
    return model


def options(family: str) -> dict[str, Any]:
    """param_groups arguments a user of the family passes (DeepSeek: fused-expert count,
    which must not cut its shared experts)."""
    return {"num_experts": EXPERTS} if family == "deepseek_v3" else {}


def _dense_attention(bias: bool = False, norms: bool = False) -> dict[str, str]:
    rows = {
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
    }
    if bias:
        rows.update({f"self_attn.{p}_proj.bias": "adamw" for p in "qkv"})
    if norms:
        rows.update({"self_attn.q_norm.weight": "adamw", "self_attn.k_norm.weight": "adamw"})
    return rows


_DENSE_MLP = {
    "mlp.gate_proj.weight": "matrix 48x32 | 1.225",
    "mlp.up_proj.weight": "matrix 48x32 | 1.225",
    "mlp.down_proj.weight": "matrix 32x48 | 1.000",
}
_NORMS = {"input_layernorm.weight": "adamw", "post_attention_layernorm.weight": "adamw"}
_MOE_EXPERTS = {  # [E, 2I, H] with I = 24: gate and up halves of 24x32 each
    "mlp.experts.gate_up_proj": "expert_stack 4x[48x32] parts 24+24 | 1.000/1.000",
    "mlp.experts.down_proj": "expert_stack 4x[32x24] | 1.155",
    "mlp.gate.weight": "matrix 4x32 | 1.000",
}

_LAYER_ROWS: dict[str, dict[str, str]] = {
    "llama": {**_dense_attention(), **_DENSE_MLP, **_NORMS},
    "qwen2": {**_dense_attention(bias=True), **_DENSE_MLP, **_NORMS},
    "qwen3": {**_dense_attention(norms=True), **_DENSE_MLP, **_NORMS},
    "qwen3_moe": {**_dense_attention(norms=True), **_MOE_EXPERTS, **_NORMS},
    "mixtral": {
        **_dense_attention(),
        "mlp.experts.gate_up_proj": "expert_stack 4x[96x32] parts 48+48 | 1.225/1.225",
        "mlp.experts.down_proj": "expert_stack 4x[32x48] | 1.000",
        "mlp.gate.weight": "matrix 4x32 | 1.000",
        **_NORMS,
    },
    "deepseek_v3": {
        **_DENSE_MLP,  # layer 0 (first_k_dense_replace=1)
        "self_attn.q_a_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.q_a_layernorm.weight": "adamw",
        "self_attn.q_b_proj.weight": "matrix 32x16 | 1.414",
        "self_attn.kv_a_proj_with_mqa.weight[0:8]": "matrix 8x32 | 1.000",  # latent kv
        "self_attn.kv_a_proj_with_mqa.weight[8:12]": "matrix 4x32 | 1.000",  # rope key
        "self_attn.kv_a_layernorm.weight": "adamw",
        "self_attn.kv_b_proj.weight": "matrix 48x8 parts 4+8 x4 interleaved | 1.414/2.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        **_MOE_EXPERTS,
        "mlp.shared_experts.gate_proj.weight": "matrix 24x32 | 1.000",
        "mlp.shared_experts.up_proj.weight": "matrix 24x32 | 1.000",
        "mlp.shared_experts.down_proj.weight": "matrix 32x24 | 1.155",
        **_NORMS,
    },
    "gpt_oss": {
        **_dense_attention(bias=True),
        "self_attn.o_proj.bias": "adamw",
        "self_attn.sinks": "adamw",
        "mlp.router.weight": "matrix 4x32 | 1.000",
        "mlp.router.bias": "adamw",
        # [E, H, 2I] stored [in, out], gate and up alternating: parts of 32 in x 24 out
        "mlp.experts.gate_up_proj": (
            "expert_stack 4x[32x48] in-out parts 1+1 x24 interleaved | 1.000/1.000"
        ),
        "mlp.experts.gate_up_proj_bias": "adamw",
        # [E, I, H] stored [in, out]: 32 outputs, 24 inputs
        "mlp.experts.down_proj": "expert_stack 4x[24x32] in-out | 1.155",
        "mlp.experts.down_proj_bias": "adamw",
        **_NORMS,
    },
    "phi3": {
        "self_attn.qkv_proj.weight[0:32]": "matrix 32x32 | 1.000",
        "self_attn.qkv_proj.weight[32:48]": "matrix 16x32 | 1.000",
        "self_attn.qkv_proj.weight[48:64]": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "mlp.gate_up_proj.weight[0:48]": "matrix 48x32 | 1.225",
        "mlp.gate_up_proj.weight[48:96]": "matrix 48x32 | 1.225",
        "mlp.down_proj.weight": "matrix 32x48 | 1.000",
        **_NORMS,
    },
    "gemma": {**_dense_attention(), **_DENSE_MLP, **_NORMS},
    "gemma3": {
        **_dense_attention(norms=True),
        **_DENSE_MLP,
        **_NORMS,
        "pre_feedforward_layernorm.weight": "adamw",
        "post_feedforward_layernorm.weight": "adamw",
    },
}
# Whole-model tables of the other families.
_WHOLE: dict[str, dict[str, str]] = {
    "llama4": {
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "feed_forward.gate_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.up_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.down_proj.weight": "matrix 32x48 | 1.000",
        "feed_forward.router.weight": "matrix 4x32 | 1.000",
        "feed_forward.shared_expert.gate_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.shared_expert.up_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.shared_expert.down_proj.weight": "matrix 32x48 | 1.000",
        "feed_forward.experts.gate_up_proj": (
            "expert_stack 4x[32x96] in-out parts 48+48 | 1.225/1.225"
        ),
        "feed_forward.experts.down_proj": "expert_stack 4x[48x32] in-out | 1.000",
        "model.embed_tokens.weight": "adamw",
        "lm_head.weight": "adamw",
        "input_layernorm.weight": "adamw",
        "post_attention_layernorm.weight": "adamw",
        "model.norm.weight": "adamw",
    },
    "gpt2": {
        "attn.c_attn.weight": "matrix 32x96 in-out parts 32+32+32 | 1.000/1.000/1.000",
        "attn.c_proj.weight": "matrix 32x32 in-out | 1.000",
        "mlp.c_fc.weight": "matrix 32x128 in-out | 2.000",
        "mlp.c_proj.weight": "matrix 128x32 in-out | 1.000",
        "transformer.wte.weight": "adamw",
        "transformer.wpe.weight": "adamw",
        "ln_1.weight": "adamw",
        "ln_1.bias": "adamw",
        "attn.c_attn.bias": "adamw",
        "attn.c_proj.bias": "adamw",
        "ln_2.weight": "adamw",
        "ln_2.bias": "adamw",
        "mlp.c_fc.bias": "adamw",
        "mlp.c_proj.bias": "adamw",
        "transformer.ln_f.weight": "adamw",
        "transformer.ln_f.bias": "adamw",
    },
    "gpt_neox": {
        "attention.query_key_value.weight": (
            "matrix 96x32 parts 8+8+8 x4 interleaved | 1.000/1.000/1.000"
        ),
        "attention.dense.weight": "matrix 32x32 | 1.000",
        "mlp.dense_h_to_4h.weight": "matrix 48x32 | 1.225",
        "mlp.dense_4h_to_h.weight": "matrix 32x48 | 1.000",
        "gpt_neox.embed_in.weight": "adamw",
        "lm_head.weight": "adamw",
        "input_layernorm.weight": "adamw",
        "input_layernorm.bias": "adamw",
        "post_attention_layernorm.weight": "adamw",
        "post_attention_layernorm.bias": "adamw",
        "attention.query_key_value.bias": "adamw",
        "attention.dense.bias": "adamw",
        "mlp.dense_h_to_4h.bias": "adamw",
        "mlp.dense_4h_to_h.bias": "adamw",
        "gpt_neox.final_layer_norm.weight": "adamw",
        "gpt_neox.final_layer_norm.bias": "adamw",
    },
    "gpt_bigcode": {
        "attn.c_attn.weight[0:32]": "matrix 32x32 | 1.000",
        "attn.c_attn.weight[32:40]": "matrix 8x32 | 1.000",
        "attn.c_attn.weight[40:48]": "matrix 8x32 | 1.000",
        "attn.c_proj.weight": "matrix 32x32 | 1.000",
        "mlp.c_fc.weight": "matrix 128x32 | 2.000",
        "mlp.c_proj.weight": "matrix 32x128 | 1.000",
        "transformer.wte.weight": "adamw",
        "transformer.wpe.weight": "adamw",
        "ln_1.weight": "adamw",
        "ln_1.bias": "adamw",
        "attn.c_attn.bias": "adamw",
        "attn.c_proj.bias": "adamw",
        "ln_2.weight": "adamw",
        "ln_2.bias": "adamw",
        "mlp.c_fc.bias": "adamw",
        "mlp.c_proj.bias": "adamw",
        "transformer.ln_f.weight": "adamw",
        "transformer.ln_f.bias": "adamw",
    },
    "dbrx": {
        "norm_attn_norm.attn.Wqkv.weight[0:32]": "matrix 32x32 | 1.000",
        "norm_attn_norm.attn.Wqkv.weight[32:48]": "matrix 16x32 | 1.000",
        "norm_attn_norm.attn.Wqkv.weight[48:64]": "matrix 16x32 | 1.000",
        "norm_attn_norm.attn.out_proj.weight": "matrix 32x32 | 1.000",
        "ffn.router.layer.weight": "matrix 4x32 | 1.000",
        "ffn.experts.mlp.w1": "fused_experts 4x[24x32] | 1.000",
        "ffn.experts.mlp.v1": "fused_experts 4x[24x32] | 1.000",
        "ffn.experts.mlp.w2": "fused_experts 4x[24x32] in-out | 1.155",
        "transformer.wte.weight": "adamw",
        "lm_head.weight": "adamw",
        "norm_attn_norm.norm_1.weight": "adamw",
        "norm_attn_norm.norm_2.weight": "adamw",
        "transformer.norm_f.weight": "adamw",
    },
    "qwen2_moe": {
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "mlp.gate.weight": "matrix 4x32 | 1.000",
        "mlp.shared_expert.gate_proj.weight": "matrix 48x32 | 1.225",
        "mlp.shared_expert.up_proj.weight": "matrix 48x32 | 1.225",
        "mlp.shared_expert.down_proj.weight": "matrix 32x48 | 1.000",
        "mlp.experts.gate_up_proj": "expert_stack 4x[48x32] parts 24+24 | 1.000/1.000",
        "mlp.experts.down_proj": "expert_stack 4x[32x24] | 1.155",
        "model.embed_tokens.weight": "adamw",
        "mlp.shared_expert_gate.weight": "adamw",
        "lm_head.weight": "adamw",
        "self_attn.q_proj.bias": "adamw",
        "self_attn.k_proj.bias": "adamw",
        "self_attn.v_proj.bias": "adamw",
        "input_layernorm.weight": "adamw",
        "post_attention_layernorm.weight": "adamw",
        "model.norm.weight": "adamw",
    },
    "qwen3_next": {
        "linear_attn.in_proj_qkvz.weight": (
            "matrix 96x32 parts 8+8+16+16 x2 interleaved | 1.000/1.000/1.000/1.000"
        ),
        "linear_attn.in_proj_ba.weight": "matrix 8x32 parts 2+2 x2 interleaved | 1.000/1.000",
        "linear_attn.out_proj.weight": "matrix 32x32 | 1.000",
        "mlp.gate.weight": "matrix 4x32 | 1.000",
        "mlp.shared_expert.gate_proj.weight": "matrix 48x32 | 1.225",
        "mlp.shared_expert.up_proj.weight": "matrix 48x32 | 1.225",
        "mlp.shared_expert.down_proj.weight": "matrix 32x48 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "mlp.experts.gate_up_proj": "expert_stack 4x[48x32] parts 24+24 | 1.000/1.000",
        "mlp.experts.down_proj": "expert_stack 4x[32x24] | 1.155",
        "self_attn.q_proj.weight": "matrix 64x32 parts 8+8 x4 interleaved | 1.000/1.000",
        "model.embed_tokens.weight": "adamw",
        "linear_attn.conv1d.weight": "adamw",
        "mlp.shared_expert_gate.weight": "adamw",
        "lm_head.weight": "adamw",
        "linear_attn.dt_bias": "adamw",
        "linear_attn.A_log": "adamw",
        "linear_attn.norm.weight": "adamw",
        "input_layernorm.weight": "adamw",
        "post_attention_layernorm.weight": "adamw",
        "self_attn.q_norm.weight": "adamw",
        "self_attn.k_norm.weight": "adamw",
        "model.norm.weight": "adamw",
    },
    "mamba2": {
        "mixer.in_proj.weight[0:64]": "matrix 64x32 | 1.414",
        "mixer.in_proj.weight[64:128]": "matrix 64x32 | 1.414",
        "mixer.in_proj.weight[128:144]": "matrix 16x32 | 1.000",
        "mixer.in_proj.weight[144:160]": "matrix 16x32 | 1.000",
        "mixer.in_proj.weight[160:168]": "matrix 8x32 | 1.000",
        "mixer.out_proj.weight": "matrix 32x64 | 1.000",
        "backbone.embeddings.weight": "adamw",
        "mixer.conv1d.weight": "adamw",
        "lm_head.weight": "adamw",
        "norm.weight": "adamw",
        "mixer.dt_bias": "adamw",
        "mixer.A_log": "adamw",
        "mixer.D": "adamw",
        "mixer.conv1d.bias": "adamw",
        "mixer.norm.weight": "adamw",
        "backbone.norm_f.weight": "adamw",
    },
    "jamba": {
        "mamba.in_proj.weight[0:64]": "matrix 64x32 | 1.414",
        "mamba.in_proj.weight[64:128]": "matrix 64x32 | 1.414",
        "mamba.x_proj.weight[0:8]": "matrix 8x64 | 1.000",
        "mamba.x_proj.weight[8:16]": "matrix 8x64 | 1.000",
        "mamba.x_proj.weight[16:24]": "matrix 8x64 | 1.000",
        "mamba.dt_proj.weight": "matrix 64x8 | 2.828",
        "mamba.out_proj.weight": "matrix 32x64 | 1.000",
        "feed_forward.gate_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.up_proj.weight": "matrix 48x32 | 1.225",
        "feed_forward.down_proj.weight": "matrix 32x48 | 1.000",
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "feed_forward.router.weight": "matrix 4x32 | 1.000",
        "feed_forward.experts.gate_up_proj": "expert_stack 4x[96x32] parts 48+48 | 1.225/1.225",
        "feed_forward.experts.down_proj": "expert_stack 4x[32x48] | 1.000",
        "model.embed_tokens.weight": "adamw",
        "mamba.conv1d.weight": "adamw",
        "lm_head.weight": "adamw",
        "mamba.A_log": "adamw",
        "mamba.D": "adamw",
        "mamba.conv1d.bias": "adamw",
        "mamba.dt_proj.bias": "adamw",
        "mamba.dt_layernorm.weight": "adamw",
        "mamba.b_layernorm.weight": "adamw",
        "mamba.c_layernorm.weight": "adamw",
        "input_layernorm.weight": "adamw",
        "pre_ff_layernorm.weight": "adamw",
        "model.final_layernorm.weight": "adamw",
    },
    "vit": {
        "attention.q_proj.weight": "matrix 32x32 | 1.000",
        "attention.k_proj.weight": "matrix 32x32 | 1.000",
        "attention.v_proj.weight": "matrix 32x32 | 1.000",
        "attention.o_proj.weight": "matrix 32x32 | 1.000",
        "mlp.fc1.weight": "matrix 48x32 | 1.225",
        "mlp.fc2.weight": "matrix 32x48 | 1.000",
        "vit.embeddings.cls_token": "adamw",
        "vit.embeddings.position_embeddings": "adamw",
        "vit.embeddings.patch_embeddings.projection.weight": "adamw",
        "classifier.weight": "adamw",
        "vit.embeddings.patch_embeddings.projection.bias": "adamw",
        "attention.q_proj.bias": "adamw",
        "attention.k_proj.bias": "adamw",
        "attention.v_proj.bias": "adamw",
        "attention.o_proj.bias": "adamw",
        "layernorm_before.weight": "adamw",
        "layernorm_before.bias": "adamw",
        "layernorm_after.weight": "adamw",
        "layernorm_after.bias": "adamw",
        "mlp.fc1.bias": "adamw",
        "mlp.fc2.bias": "adamw",
        "vit.layernorm.weight": "adamw",
        "vit.layernorm.bias": "adamw",
        "classifier.bias": "adamw",
    },
    "whisper": {
        "self_attn.k_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.out_proj.weight": "matrix 32x32 | 1.000",
        "fc1.weight": "matrix 48x32 | 1.225",
        "fc2.weight": "matrix 32x48 | 1.000",
        "encoder_attn.k_proj.weight": "matrix 32x32 | 1.000",
        "encoder_attn.v_proj.weight": "matrix 32x32 | 1.000",
        "encoder_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "encoder_attn.out_proj.weight": "matrix 32x32 | 1.000",
        "model.encoder.conv1.weight": "adamw",
        "model.encoder.conv2.weight": "adamw",
        "model.decoder.embed_tokens.weight": "adamw",
        "model.decoder.embed_positions.weight": "adamw",
        "model.encoder.conv1.bias": "adamw",
        "model.encoder.conv2.bias": "adamw",
        "self_attn.v_proj.bias": "adamw",
        "self_attn.q_proj.bias": "adamw",
        "self_attn.out_proj.bias": "adamw",
        "self_attn_layer_norm.weight": "adamw",
        "self_attn_layer_norm.bias": "adamw",
        "fc1.bias": "adamw",
        "fc2.bias": "adamw",
        "final_layer_norm.weight": "adamw",
        "final_layer_norm.bias": "adamw",
        "model.encoder.layer_norm.weight": "adamw",
        "model.encoder.layer_norm.bias": "adamw",
        "encoder_attn.v_proj.bias": "adamw",
        "encoder_attn.q_proj.bias": "adamw",
        "encoder_attn.out_proj.bias": "adamw",
        "encoder_attn_layer_norm.weight": "adamw",
        "encoder_attn_layer_norm.bias": "adamw",
        "model.decoder.layer_norm.weight": "adamw",
        "model.decoder.layer_norm.bias": "adamw",
    },
    "modernbert": {
        "attn.Wqkv.weight[0:32]": "matrix 32x32 | 1.000",
        "attn.Wqkv.weight[32:64]": "matrix 32x32 | 1.000",
        "attn.Wqkv.weight[64:96]": "matrix 32x32 | 1.000",
        "attn.Wo.weight": "matrix 32x32 | 1.000",
        "mlp.Wo.weight": "matrix 32x48 | 1.000",
        "head.dense.weight": "matrix 32x32 | 1.000",
        "mlp.Wi.weight[0:48]": "matrix 48x32 | 1.225",
        "mlp.Wi.weight[48:96]": "matrix 48x32 | 1.225",
        "model.embeddings.tok_embeddings.weight": "adamw",
        "model.embeddings.norm.weight": "adamw",
        "mlp_norm.weight": "adamw",
        "attn_norm.weight": "adamw",
        "model.final_norm.weight": "adamw",
        "head.norm.weight": "adamw",
        "decoder.bias": "adamw",
    },
    "gemma3n": {
        "self_attn.q_proj.weight": "matrix 32x32 | 1.000",
        "self_attn.k_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.v_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.o_proj.weight": "matrix 32x32 | 1.000",
        "mlp.gate_proj.weight": "matrix 48x32 | 1.225",
        "mlp.up_proj.weight": "matrix 48x32 | 1.225",
        "mlp.down_proj.weight": "matrix 32x48 | 1.000",
        "laurel.linear_left.weight": "matrix 8x32 | 1.000",
        "laurel.linear_right.weight": "matrix 32x8 | 2.000",
        "per_layer_input_gate.weight": "matrix 8x32 | 1.000",
        "per_layer_projection.weight": "matrix 32x8 | 2.000",
        "model.per_layer_model_projection.weight": "matrix 16x32 | 1.000",
        "model.altup_projections.0.weight": "matrix 32x32 | 1.000",
        "model.altup_unembed_projections.0.weight": "matrix 32x32 | 1.000",
        "model.embed_tokens.weight": "adamw",
        "altup.correction_coefs.weight": "adamw",
        "altup.prediction_coefs.weight": "adamw",
        "altup.modality_router.weight": "adamw",
        "model.embed_tokens_per_layer.weight": "adamw",
        "self_attn.q_norm.weight": "adamw",
        "self_attn.k_norm.weight": "adamw",
        "input_layernorm.weight": "adamw",
        "post_attention_layernorm.weight": "adamw",
        "pre_feedforward_layernorm.weight": "adamw",
        "post_feedforward_layernorm.weight": "adamw",
        "altup.correct_output_scale": "adamw",
        "altup.router_norm.weight": "adamw",
        "laurel.post_laurel_norm.weight": "adamw",
        "post_per_layer_input_norm.weight": "adamw",
        "model.norm.weight": "adamw",
        "model.per_layer_projection_norm.weight": "adamw",
    },
}
# Outside the layers of the families above: embeddings, the head (absent when tied) and
# the final norm.
_TOP = {
    "model.embed_tokens.weight": "adamw",
    "model.norm.weight": "adamw",
    "lm_head.weight": "adamw",
}
_TIED = ("gemma", "gemma3")
EXPECTED: dict[str, dict[str, str]] = {
    **{
        family: {**rows, **{k: v for k, v in _TOP.items() if k != "lm_head.weight"}}
        if family in _TIED
        else {**rows, **_TOP}
        for family, rows in _LAYER_ROWS.items()
    },
    **_WHOLE,
}


_LAYER = re.compile(r"^.*?\.(layers|h|blocks)\.\d+\.")


def routing(groups: list[dict[str, Any]]) -> dict[str, str]:
    """param_groups' routing table as ``view | lr scales`` for Muon views and ``adamw`` for
    the rest; rows inside layers are keyed by their name within the layer (all layers that
    hold it must agree), the rest by their full name."""
    out: dict[str, str] = {}
    for e in muon_dist.routing.table.routing_entries(groups):
        name = _LAYER.sub("", e.name)
        row = "adamw" if e.algorithm == "adamw" else f"{e.view} | {e.scale_text}"
        out[name] = row if out.get(name, row) == row else f"layers disagree: {out[name]}, {row}"
    return out


# ---------------------------------------------------------------------------------------
# The first update, block by block


_D = HEAD_DIM
# Per family, (name suffix, how its forward reads the parameter): fused parts, [in, out]
# storage, fused experts. Written from the modeling code, independently of muon_dist.
_TRUE_LAYOUTS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    # x @ W[e], then gate_up[..., ::2], gate_up[..., 1::2]; x @ W[e]
    "gpt_oss": (
        ("experts.gate_up_proj", {"split_sizes": [1, 1], "split_groups": 24, "transposed": True}),
        ("experts.down_proj", {"transposed": True}),
    ),
    "mixtral": (("experts.gate_up_proj", {"split_sizes": [48, 48]}),),  # chunk(2, dim=-1)
    "jamba": (
        ("experts.gate_up_proj", {"split_sizes": [48, 48]}),
        ("mamba.in_proj.weight", {"split_sizes": [64, 64]}),  # hidden, gate = chunk(2)
        ("mamba.x_proj.weight", {"split_sizes": [8, 8, 8]}),  # dt_rank, d_state, d_state
    ),
    # bmm(x, W[e]) then chunk(2, dim=-1); bmm(h, W[e])
    "llama4": (
        ("experts.gate_up_proj", {"split_sizes": [48, 48], "transposed": True}),
        ("experts.down_proj", {"transposed": True}),
    ),
    # q, k, v along the outputs; gate and up halves
    "phi3": (
        ("qkv_proj.weight", {"split_sizes": [HEADS * _D, KV_HEADS * _D, KV_HEADS * _D]}),
        ("gate_up_proj.weight", {"split_sizes": [48, 48]}),
    ),
    # Conv1D: x @ W; c_attn split(n_embd, dim=2)
    "gpt2": (
        ("c_attn.weight", {"split_sizes": [32, 32, 32], "transposed": True}),
        ("weight", {"transposed": True}),
    ),
    "gpt_bigcode": (("c_attn.weight", {"split_sizes": [32, _D, _D]}),),  # multi-query
    # view(..., heads, 3 * head_dim).chunk(3, dim=-1)
    "gpt_neox": (("query_key_value.weight", {"split_sizes": [_D] * 3, "split_groups": HEADS}),),
    # Wqkv split(hidden, kv * d, kv * d); expert weights viewed [E, F, H]: x @ w1[e].T,
    # x @ v1[e].T, h @ w2[e]
    "dbrx": (
        ("Wqkv.weight", {"split_sizes": [32, KV_HEADS * _D, KV_HEADS * _D]}),
        ("mlp.w2", {"num_experts": EXPERTS, "transposed": True}),
        ("mlp.w1", {"num_experts": EXPERTS}),
        ("mlp.v1", {"num_experts": EXPERTS}),
    ),
    "qwen3_next": (
        # view(..., heads, 2 * head_dim).chunk(2, dim=-1): q, gate per head
        ("self_attn.q_proj.weight", {"split_sizes": [_D, _D], "split_groups": HEADS}),
        # per key head: q (dk), k (dk), v (nv/nk * dv), z (nv/nk * dv); b, a (nv/nk each)
        ("in_proj_qkvz.weight", {"split_sizes": [8, 8, 16, 16], "split_groups": 2}),
        ("in_proj_ba.weight", {"split_sizes": [2, 2], "split_groups": 2}),
    ),
    # split([kv_lora_rank, qk_rope_head_dim]): the latent kv and the rope key
    "deepseek_v3": (
        ("kv_a_proj_with_mqa.weight", {"split_sizes": [8, 4]}),
        # kv_b_proj(x).view(..., heads, nope + v).split([nope, v]): per head k, v
        ("kv_b_proj.weight", {"split_sizes": [4, 8], "split_groups": HEADS}),
    ),
    # gate (I), x (I), B (G N), C (G N), dt (heads)
    "mamba2": (("mixer.in_proj.weight", {"split_sizes": [64, 64, 16, 16, 8]}),),
    # Wqkv viewed [.., 3, heads, d]; Wi chunk(2, dim=-1)
    "modernbert": (
        ("Wqkv.weight", {"split_sizes": [32, 32, 32]}),
        ("Wi.weight", {"split_sizes": [48, 48]}),
    ),
}


def true_layout(family: str, name: str) -> dict[str, Any]:
    """How the family's modeling code reads a parameter (see its forward)."""
    for suffix, layout in _TRUE_LAYOUTS.get(family, ()):
        if name.endswith(suffix):
            return layout
    if name.endswith("experts.gate_up_proj"):  # linear(x, W[e]).chunk(2, dim=-1)
        return {"split_sizes": [24, 24]}
    return {}


def _blocks(delta: torch.Tensor, group: dict[str, Any]) -> list[tuple[str, torch.Tensor, int, int]]:
    """Each orthogonalized block of an update as (label, [out, in] matrix, out, in), cut by
    ``group``'s ``split_sizes``, ``split_groups`` and ``transposed``."""
    if group.get("num_experts"):
        delta = delta.reshape(group["num_experts"], -1, delta.shape[-1])
    mats = list(delta) if delta.ndim == 3 else [delta]
    out = []
    for e, m in enumerate(mats):
        m = m.T if group.get("transposed") else m
        sizes = group.get("split_sizes")
        repeats = group.get("split_groups", 1)
        if sizes is None:
            out.append((f"expert {e}", m, *m.shape))
            continue
        cut = m.reshape(repeats, sum(sizes), m.shape[1])
        offset = 0
        for j, size in enumerate(sizes):
            part = cut[:, offset : offset + size].reshape(repeats * size, m.shape[1])
            out.append((f"expert {e} part {j}", part, *part.shape))
            offset += size
    return out


def check_first_update(
    name: str,
    before: torch.Tensor,
    after: torch.Tensor,
    grad: torch.Tensor,
    layout: dict[str, Any],
    lr: float,
) -> list[str]:
    """Problems with one Muon parameter's first update. Each block (per expert, per part),
    divided by lr and its own spectral scale, must equal Newton–Schulz of the same block of
    the gradient (the first Nesterov input is a multiple of it) within fp32 rounding, and be
    orthogonal: largest singular value in [0.9, 1.25].

    Equality with Newton–Schulz of each block rather than a band on every singular value: a
    gradient at initialisation can be nearly rank-deficient (attention output projections)
    and Newton–Schulz leaves those directions small. Orthogonalizing a fused matrix whole,
    or a wrong lr scale (sqrt(2), 1.155), is off by far more than the tolerance.
    """
    problems = []
    updates = _blocks((before - after).double(), layout)
    inputs = _blocks(grad.double(), layout)
    for (label, block, rows, cols), (_, g, _, _) in zip(updates, inputs, strict=True):
        scale = math.sqrt(max(1.0, rows / cols))
        update = block.detach() / (lr * scale)
        reference = newton_schulz(
            g.float(), steps=5, coefficients="quintic", dtype=torch.float32
        ).double()
        error = float((update - reference).norm() / reference.norm())
        top = float(torch.linalg.svdvals(update).max())
        if error > 1e-3 or not 0.9 <= top <= 1.25:
            problems.append(f"{name} {label}: relative error {error:.3f}, top singular {top:.3f}")
    return problems


def batch(vocab: int = 64, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (4, 48), generator=generator)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of blocks (``layers``, GPT-2's ``h``, DBRX's ``blocks``)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return module
    raise ValueError(f"{type(model).__name__} has no layers")


def first_update_problems(family: str) -> list[str]:
    """One step of Muon (fp32) from random gradients, one process: every Muon parameter's
    update checked block by block (per expert, per part) against the family's forward."""
    return model_update_problems(
        build(family), lambda name: true_layout(family, name), **options(family)
    )


def model_update_problems(
    model: nn.Module, layout_of: Callable[[str], dict[str, Any]], **routing: Any
) -> list[str]:
    """:func:`first_update_problems` for any model, ``layout_of(name)`` giving how its
    forward reads each parameter."""
    groups = muon_dist.param_groups(model, **routing)
    lr = 0.02
    opt = muon_dist.Muon(groups, lr=lr, comm_dtype=torch.float32, ns_dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    opt.step()
    problems = []
    for name, group, p in muon_dist.plan.views.named_params(opt.param_groups):
        if group["algorithm"] == "muon":
            grad = p.grad
            assert grad is not None
            problems += check_first_update(name, before[name], p, grad, layout_of(name), lr)
    return problems


Gather = Callable[[torch.Tensor], torch.Tensor]


def train_families(rank: int, world_size: int, families: tuple[str, ...]) -> dict[str, Any]:
    """Per family, on every rank: FSDP2 per decoder layer, param_groups, Muon; the first
    update's per-block orthogonality and three steps' losses (from rank 0's view)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for family in families:
        model = build(family)
        for layer in layers(model):
            fully_shard(layer)
        fully_shard(model)
        groups = muon_dist.param_groups(model, **options(family))
        lr = 0.02
        fp32 = torch.float32
        opt = muon_dist.Muon(groups, lr=lr, adamw_lr=3e-3, comm_dtype=fp32, ns_dtype=fp32)

        def full(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

        muon = [(n, g, p) for n, g, p in muon_dist.plan.views.named_params(opt.param_groups)]
        muon = [(n, g, p) for n, g, p in muon if g["algorithm"] == "muon"]
        before = {n: full(p) for n, _, p in muon}
        ids = batch()
        losses = []
        problems: list[str] = []
        for step in range(4):
            loss = loss_of(model, ids)
            losses.append(float(loss.detach()))
            if step == 3:
                break
            loss.backward()
            grads = {n: full(p.grad) for n, _, p in muon}
            opt.step()
            opt.zero_grad()
            if step == 0:
                for n, _, p in muon:
                    layout = true_layout(family, n)
                    problems += check_first_update(n, before[n], full(p), grads[n], layout, lr)
        report[family] = {"losses": losses, "problems": problems, "routing": routing(groups)}
    return report


# ---------------------------------------------------------------------------------------
# The README's family table, rendered from the same models and routing the tests check

_PLAIN = {
    "muon": ("Linear [out, in]",),
    "adamw": ("bias", "vector (norm, scale or gain)", "embedding", "output head"),
}
_TITLES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral",
    "deepseek_v3": "DeepSeek-V3",
    "gpt_oss": "GPT-OSS",
    "phi3": "Phi-3",
    "gemma": "Gemma",
    "gemma3": "Gemma 3",
    "llama4": "Llama 4",
    "gpt2": "GPT-2",
    "gpt_neox": "GPT-NeoX",
    "gpt_bigcode": "GPT-BigCode",
    "dbrx": "DBRX",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_next": "Qwen3-Next",
    "mamba2": "Mamba2",
    "jamba": "Jamba",
    "vit": "ViT",
    "whisper": "Whisper",
    "modernbert": "ModernBERT",
    "gemma3n": "Gemma 3n",
}


def family_rows(family: str) -> list[str]:
    """The parameters of a family whose routing is not the plain default, one per name
    within a layer: ``name``: view (lr scales) or AdamW — reason."""
    model = build(family)
    from muon_dist.routing.param_groups import route_model

    routes = route_model(model, **options(family))
    # One routing of the model (each observes its forward), read for every row below.
    entries = muon_dist.routing.table.routing_entries(
        muon_dist.param_groups(model, **options(family))
    )
    rows: dict[str, str] = {}
    for e in entries:
        base = e.name.split("[")[0]
        reason = routes[base][1].reason
        if reason in _PLAIN[e.algorithm]:
            continue
        key = _LAYER.sub("", base)
        if e.algorithm == "muon":
            text = f"`{key}` {e.view.split(' ', 1)[1]}, lr ×{e.scale_text}"
            if e.name != base:  # row blocks of a split 2-D weight: list them once
                blocks = [f.view.split(" ", 1)[1] for f in entries if f.name.split("[")[0] == base]
                text = f"`{key}` row blocks {' + '.join(blocks)}"
        else:
            text = f"`{key}` AdamW"
        rows.setdefault(key, f"{text} — {reason}")
    return list(rows.values())


def family_table() -> str:
    """The README's family table (between its ``table:families`` markers)."""
    lines = ["| family | routed by structure or the family table (the rest: plain default) |"]
    lines.append("| --- | --- |")
    for family in FAMILIES:
        rows = family_rows(family)
        lines.append(f"| {_TITLES[family]} | {'<br>'.join(rows) or 'plain default'} |")
    return "\n".join(lines)
