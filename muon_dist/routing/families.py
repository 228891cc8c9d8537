"""Fused layouts that structure cannot tell: the family table.

:mod:`muon_dist.routing.structure` reads orientation and contiguous fused splits from module types,
shapes and the config. What it cannot read is *how* a fused output is interleaved, or a
split whose sizes are not plain config dimensions; those come from each family's forward
(transformers 5.23), one rule per parameter, keyed by ``model.config.model_type`` (or, for
torchtitan, the owning module's attributes). Each rule gets the parameter's output and input
sizes as its module applies it (orientation already read) and returns the group options of
its parts and the reason, or None where its shape does not fit.

=========================  ========================================  ==========================
family                     parameter                                 parts (per its forward)
=========================  ========================================  ==========================
GPT-OSS                    ``experts.gate_up_proj [E, H, 2I]``       gate, up alternate
GPT-NeoX, Bloom            ``query_key_value [3 H, H]``              ``[heads, 3, d]``: q, k, v
                                                                     per head
Falcon                     ``query_key_value``                       per head, per kv group, or
                                                                     q heads then k, v
DBRX                       ``experts.mlp.w2 [E F, H]``               stored ``[in, out]``
Qwen3-Next                 ``self_attn.q_proj [2 Hq d, H]``          ``[heads, 2, d]``: q, gate
Qwen3-Next                 ``linear_attn.in_proj_qkvz``              per key head: q, k, v, z
Qwen3-Next                 ``linear_attn.in_proj_ba``                per key head: b, a
Mamba2, Falcon-H1          ``in_proj``                               z, x, B, C, dt
Mamba, FalconMamba, Jamba  ``in_proj [2 I, H]``, ``x_proj``          x, z halves; dt, B, C
torchtitan                 ``qkv_linear.wqkv``, ``mlp1_weight_EGD``  per kv head q, k, v;
                                                                     gate, up alternate
=========================  ========================================  ==========================
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from muon_dist.routing.structure import ViewOptions, positive_ints

Rule = Callable[[Any, int, int], tuple[ViewOptions, str] | None]
"""``(config, out_dim, in_dim) -> (options, reason)`` for one family's parameter."""

# Name parts that suggest several matrices fused into one parameter.
FUSED_HINT = re.compile(
    r"gate_up|up_gate|qkv|w13|w1w3|w12|mlp1_weight|query_key_value|c_attn|input_linear|"
    r"in_proj|x_proj",
    re.IGNORECASE,
)


def _int(config: Any, name: str) -> int | None:
    found = positive_ints(config, (name,))
    return found[0] if found else None


def _interleaved(sizes: list[int], out_dim: int, why: str) -> tuple[ViewOptions, str] | None:
    if not sizes or not all(s > 0 for s in sizes) or out_dim % sum(sizes):
        return None
    groups = out_dim // sum(sizes)
    options: ViewOptions = {"split_sizes": sizes}
    if groups > 1:
        options["split_groups"] = groups
    return options, why


def _gpt_oss_gate_up(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    return _interleaved([1, 1], out_dim, "family rule gpt_oss: gate_up[..., ::2], [..., 1::2]")


def _per_head_qkv(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    heads = _int(config, "num_attention_heads") or _int(config, "n_head")
    if heads is None or out_dim % (3 * heads):
        return None
    d = out_dim // (3 * heads)
    return _interleaved([d, d, d], out_dim, f"family rule {config.model_type}: [heads, 3, d]")


def _dbrx_w2(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    return {"transposed": True}, "family rule dbrx: x @ w2[e] reads [in, out]"


def _qwen3_next_q(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    heads, d = _int(config, "num_attention_heads"), _int(config, "head_dim")
    if heads is None or d is None or out_dim != 2 * heads * d:
        return None
    return _interleaved([d, d], out_dim, "family rule qwen3_next: [heads, 2, d]: q, gate")


def _linear_heads(config: Any) -> tuple[int, int, int, int] | None:
    names = ("linear_num_key_heads", "linear_num_value_heads")
    dims = ("linear_key_head_dim", "linear_value_head_dim")
    found = [_int(config, n) for n in (*names, *dims)]
    if any(v is None for v in found):
        return None
    nk, nv, dk, dv = (int(v) for v in found if v is not None)
    return (nk, nv, dk, dv) if nv % nk == 0 else None


def _qwen3_next_qkvz(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    heads = _linear_heads(config)
    if heads is None:
        return None
    nk, nv, dk, dv = heads
    r = nv // nk
    why = "family rule qwen3_next: per key head q, k, v, z"
    return (
        _interleaved([dk, dk, r * dv, r * dv], out_dim, why)
        if out_dim == nk * (2 * dk + 2 * r * dv)
        else None
    )


def _qwen3_next_ba(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    heads = _linear_heads(config)
    if heads is None or out_dim != 2 * heads[1]:
        return None
    r = heads[1] // heads[0]
    return _interleaved([r, r], out_dim, "family rule qwen3_next: per key head b, a")


def _ssd_in_proj(heads_key: str, groups_key: str, state_key: str, family: str) -> Rule:
    """Mamba2-style ``in_proj``: gate z and x (``inner`` each), B and C (``groups * state``
    each), dt (one per head); ``inner`` is what the outputs leave for z and x."""

    def rule(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
        heads, groups, state = (_int(config, k) for k in (heads_key, groups_key, state_key))
        if heads is None or groups is None or state is None:
            return None
        inner, odd = divmod(out_dim - 2 * groups * state - heads, 2)
        if inner < 1 or odd:
            return None
        sizes = [inner, inner, groups * state, groups * state, heads]
        return {"split_sizes": sizes}, f"family rule {family}: z, x, B, C, dt"

    return rule


def _falcon_qkv(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    heads = _int(config, "num_attention_heads")
    if heads is None or in_dim % heads:
        return None
    d = in_dim // heads
    if getattr(config, "new_decoder_architecture", False):  # per kv group: r q heads, k, v
        kv = _int(config, "num_kv_heads") or heads
        why = "family rule falcon: per kv group q heads, k, v"
        return _interleaved([heads // kv * d, d, d], out_dim, why) if heads % kv == 0 else None
    if getattr(config, "multi_query", False):  # q heads, then one k and one v head
        return {"split_sizes": [heads * d, d, d]}, "family rule falcon: q heads, k, v"
    return _interleaved([d, d, d], out_dim, "family rule falcon: [heads, 3, d]")


def _halves(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    if out_dim % 2:
        return None
    half = out_dim // 2
    return {"split_sizes": [half, half]}, f"family rule {config.model_type}: x and z halves"


def _x_proj(config: Any, out_dim: int, in_dim: int) -> tuple[ViewOptions, str] | None:
    state = _int(config, "state_size") or _int(config, "mamba_d_state")
    if state is None or out_dim <= 2 * state:
        return None
    sizes = [out_dim - 2 * state, state, state]
    return {"split_sizes": sizes}, f"family rule {config.model_type}: dt, B, C"


# model_type -> (name suffix regex, rule)
_RULES: dict[str, tuple[tuple[str, Rule], ...]] = {
    "gpt_oss": ((r"experts\.gate_up_proj$", _gpt_oss_gate_up),),
    "gpt_neox": ((r"attention\.query_key_value\.weight$", _per_head_qkv),),
    "bloom": ((r"self_attention\.query_key_value\.weight$", _per_head_qkv),),
    "dbrx": ((r"experts\.mlp\.w2$", _dbrx_w2),),
    "qwen3_next": (
        (r"self_attn\.q_proj\.weight$", _qwen3_next_q),
        (r"linear_attn\.in_proj_qkvz\.weight$", _qwen3_next_qkvz),
        (r"linear_attn\.in_proj_ba\.weight$", _qwen3_next_ba),
    ),
    "mamba2": (
        (r"mixer\.in_proj\.weight$", _ssd_in_proj("num_heads", "n_groups", "state_size", "mamba2")),
    ),
    "falcon_h1": (
        (
            r"mamba\.in_proj\.weight$",
            _ssd_in_proj("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "falcon_h1"),
        ),
    ),
    "falcon": ((r"self_attention\.query_key_value\.weight$", _falcon_qkv),),
    "mamba": ((r"mixer\.in_proj\.weight$", _halves), (r"mixer\.x_proj\.weight$", _x_proj)),
    "falcon_mamba": (
        (r"mixer\.in_proj\.weight$", _halves),
        (r"mixer\.x_proj\.weight$", _x_proj),
    ),
    "jamba": ((r"mamba\.in_proj\.weight$", _halves), (r"mamba\.x_proj\.weight$", _x_proj)),
}


def family_rule(
    config: Any, name: str, out_dim: int, in_dim: int
) -> tuple[ViewOptions, str] | None:
    """The family table's options for a Hugging Face model's parameter, or None."""
    model_type = getattr(config, "model_type", None)
    for pattern, rule in _RULES.get(model_type or "", ()):
        if re.search(pattern, name):
            return rule(config, out_dim, in_dim)
    return None


def titan_rule(
    owner: nn.Module | None, grandparent: nn.Module | None, name: str, out_dim: int
) -> tuple[ViewOptions, str] | None:
    """torchtitan's fused layouts: GPT-OSS ``mlp1_weight_EGD`` (gate and up alternate) and
    ``FusedQKVLinear.wqkv`` (per key-value head, ``heads_per_kv`` query heads, k, v)."""
    if name.split(".")[-1] == "mlp1_weight_EGD":
        return _interleaved([1, 1], out_dim, "family rule torchtitan gpt_oss: gate, up alternate")
    if name.split(".")[-2:] != ["wqkv", "weight"] or not isinstance(owner, nn.Linear):
        return None
    per_kv = positive_ints(grandparent, ("heads_per_kv",))
    head_dim = positive_ints(grandparent, ("head_dim",))
    if not per_kv or not head_dim:
        return None
    sizes = [per_kv[0] * head_dim[0], head_dim[0], head_dim[0]]
    return _interleaved(
        sizes, out_dim, "family rule torchtitan FusedQKVLinear: per kv head q, k, v"
    )


def suggests_fusion(name: str) -> bool:
    """Whether a parameter's own name (not its module path) hints at fused matrices."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    return FUSED_HINT.search(leaf) is not None
