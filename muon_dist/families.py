"""Layouts of popular model families that parameter names alone do not tell.

:func:`muon_dist.param_groups` asks :func:`known_layout` for every Muon matrix. It answers
from the parameter's name, its shape, its owning module's attributes and, for Hugging Face
models, ``model.config``; it never reads tensor values, so every rank gets the same answer.

Known layouts (``E`` experts, ``H`` hidden size, ``I`` expert width, ``d`` head size):

- transformers Qwen3-MoE, Mixtral, DeepSeek-V3: ``mlp.experts.gate_up_proj [E, 2I, H]``:
  gate and up halves.
- transformers GPT-OSS: ``mlp.experts.gate_up_proj [E, H, 2I]``: stored ``[in, out]``,
  gate and up alternating; ``mlp.experts.down_proj [E, I, H]``: stored ``[in, out]``.
- transformers Phi-3: ``self_attn.qkv_proj [(Hq + 2 Hkv) d, H]``: q, k, v blocks (head
  counts from ``model.config``); ``mlp.gate_up_proj [2I, H]``: gate and up halves.
- torchtitan fused QKV: ``qkv_linear.wqkv [Hkv (r + 2) d, D]``: per key-value head, r query
  heads, then k, then v (``r`` and ``d`` from the owning module).
- torchtitan GPT-OSS: ``mlp1_weight_EGD [E, 2F, D]``: gate and up alternating.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

Layout = dict[str, Any]
"""Group options for one parameter: ``split_sizes``, ``split_groups``, ``transposed``."""

# transformers model types whose expert stacks are stored [E, in, out] with gate and up
# alternating along the output axis.
_IN_OUT_EXPERTS = frozenset({"gpt_oss"})
# Name parts that suggest several matrices fused into one parameter.
FUSED_HINT = re.compile(r"gate_up|up_gate|qkv|w13|w1w3|w12|mlp1_weight")


def _config(model: nn.Module) -> Any:
    """A Hugging Face model's config (``model.config`` with a ``model_type``), or None."""
    config = getattr(model, "config", None)
    return config if isinstance(getattr(config, "model_type", None), str) else None


def _int_attr(obj: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _hf_layout(config: Any, name: str, shape: tuple[int, ...]) -> Layout | None:
    model_type = config.model_type
    last = name.split(".")[-2:]
    if last == ["experts", "gate_up_proj"] and len(shape) == 3:
        if model_type in _IN_OUT_EXPERTS:
            return {"split_sizes": [1, 1], "split_groups": shape[2] // 2, "transposed": True}
        return {"split_sizes": [shape[1] // 2] * 2}
    if last == ["experts", "down_proj"] and len(shape) == 3 and model_type in _IN_OUT_EXPERTS:
        return {"transposed": True}
    if last == ["gate_up_proj", "weight"] and len(shape) == 2:
        return {"split_sizes": [shape[0] // 2] * 2}
    if last == ["qkv_proj", "weight"] and len(shape) == 2:
        heads = _int_attr(config, "num_attention_heads")
        kv_heads = _int_attr(config, "num_key_value_heads") or heads
        hidden = _int_attr(config, "hidden_size")
        if heads is None or kv_heads is None or hidden is None:
            return None
        head_dim = _int_attr(config, "head_dim") or hidden // heads
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        return {"split_sizes": sizes} if sum(sizes) == shape[0] else None
    return None


def _titan_layout(owner: nn.Module | None, name: str, shape: tuple[int, ...]) -> Layout | None:
    last = name.split(".")[-1]
    if last == "mlp1_weight_EGD" and len(shape) == 3:
        return {"split_sizes": [1, 1], "split_groups": shape[1] // 2}
    per_kv, head_dim = _int_attr(owner, "heads_per_kv"), _int_attr(owner, "head_dim")
    fused_qkv = name.split(".")[-2:] == ["wqkv", "weight"] and len(shape) == 2
    if fused_qkv and per_kv is not None and head_dim is not None:
        group = (per_kv + 2) * head_dim
        if shape[0] % group == 0:
            return {
                "split_sizes": [per_kv * head_dim, head_dim, head_dim],
                "split_groups": shape[0] // group,
            }
    return None


def known_layout(
    model: nn.Module, name: str, param: torch.Tensor, modules: dict[str, nn.Module]
) -> Layout | None:
    """The layout options of a known family's parameter, or None where the default holds.

    ``name`` is normalised; ``modules`` maps normalised module names to modules, so the
    fused-QKV module that owns a torchtitan ``wqkv`` can be read.
    """
    shape = tuple(param.shape)
    config = _config(model)
    if config is not None:
        layout = _hf_layout(config, name, shape)
        if layout is not None:
            return layout
    parts = name.split(".")
    grandparent = modules.get(".".join(parts[:-2])) if len(parts) > 2 else None
    return _titan_layout(grandparent, name, shape)


def suggests_fusion(name: str) -> bool:
    """Whether a parameter's own name (not its module path) hints at fused matrices."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    return FUSED_HINT.search(leaf) is not None
