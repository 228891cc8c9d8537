"""Real model families from tiny configs, and what param_groups must make of them.

Each family is built by the installed ``transformers`` from a small config. Shapes are
chosen so that a wrong routing shows: fused gate+up matrices have more outputs than inputs
(orthogonalizing them whole leaves each part's singular values well below 1), and GPT-OSS's
``[in, out]`` down projection has more outputs than inputs (its lr scale is not 1).
``EXPECTED`` is the routing table of layer 1 (the MoE layer where there is one), written
from each family's modeling code: matrix view, and the lr scale of every part.
"""

from __future__ import annotations

import math
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
                "attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0},
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

EXPECTED: dict[str, dict[str, str]] = {
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
        "self_attn.q_a_proj.weight": "matrix 16x32 | 1.000",
        "self_attn.q_a_layernorm.weight": "adamw",
        "self_attn.q_b_proj.weight": "matrix 32x16 | 1.414",
        "self_attn.kv_a_proj_with_mqa.weight": "matrix 12x32 | 1.000",
        "self_attn.kv_a_layernorm.weight": "adamw",
        "self_attn.kv_b_proj.weight": "matrix 48x8 | 2.449",
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
# Outside the layers: embeddings and the head (absent when tied) and the final norm.
TOP = {
    "model.embed_tokens.weight": "adamw",
    "model.norm.weight": "adamw",
    "lm_head.weight": "adamw",
}
TIED = ("gemma", "gemma3")


def routing(groups: list[dict[str, Any]]) -> dict[str, str]:
    """Layer 1's rows and the top-level rows of param_groups' routing table, as
    ``view | lr scales`` for Muon views and ``adamw`` for the rest."""
    out = {}
    for e in muon_dist.routing.routing_entries(groups):
        if ".layers." in e.name and ".layers.1." not in e.name:
            continue
        name = e.name.replace("model.layers.1.", "")
        out[name] = "adamw" if e.algorithm == "adamw" else f"{e.view} | {e.scale_text}"
    return out


def expected(family: str) -> dict[str, str]:
    top = {k: v for k, v in TOP.items() if not (family in TIED and k == "lm_head.weight")}
    return {**EXPECTED[family], **top}


# ---------------------------------------------------------------------------------------
# The first update, block by block


def true_layout(family: str, name: str) -> dict[str, Any]:
    """How the family's modeling code reads a parameter (see its forward), written out here
    independently of muon_dist.families: fused parts, and [in, out] storage."""
    leaf = ".".join(name.split(".")[-2:])
    if leaf == "experts.gate_up_proj":
        if family == "gpt_oss":  # x @ W[e] then gate_up[..., ::2], gate_up[..., 1::2]
            return {"split_sizes": [1, 1], "split_groups": 24, "transposed": True}
        width = {"mixtral": 48}.get(family, 24)  # linear(x, W[e]).chunk(2, dim=-1)
        return {"split_sizes": [width, width]}
    if leaf == "experts.down_proj" and family == "gpt_oss":  # x @ W[e]
        return {"transposed": True}
    if leaf == "qkv_proj.weight":  # q, then k, then v along the output features
        return {"split_sizes": [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]}
    if leaf == "gate_up_proj.weight":  # chunk(2, dim=-1)
        return {"split_sizes": [48, 48]}
    return {}


def _blocks(delta: torch.Tensor, group: dict[str, Any]) -> list[tuple[str, torch.Tensor, int, int]]:
    """Each orthogonalized block of an update as (label, [out, in] matrix, out, in), cut by
    ``group``'s ``split_sizes``, ``split_groups`` and ``transposed``."""
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
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        groups = muon_dist.param_groups(model, **options(family))
        lr = 0.02
        fp32 = torch.float32
        opt = muon_dist.Muon(groups, lr=lr, adamw_lr=3e-3, comm_dtype=fp32, ns_dtype=fp32)

        def full(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

        muon = [(n, g, p) for n, g, p in muon_dist.routing.named_params(opt.param_groups)]
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
