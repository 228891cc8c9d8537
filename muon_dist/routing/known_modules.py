"""The family table: per transformers module class, how its forward reads its parameters.

Written from each forward (transformers 5.23); sizes come from the module (its attributes,
else its config), so a rule applies at any size and only to that class. A rule that
returns a :class:`Layout` without options is evidence that the parameter is one map (a
name like ``in_proj_z`` or a width that adds up proves nothing).

=================================  ===============================  ==========================
module class                       parameter                        as its forward reads it
=================================  ===============================  ==========================
GPT2Attention (and copies)         ``c_attn`` Conv1D                ``split(split_size)``
GPTBigCodeAttention                ``c_attn``                       q, k, v; per head if not
                                                                    multi-query
Phi3Attention, DbrxAttention       ``qkv_proj``, ``Wqkv``           q, k, v blocks
ModernBertAttention, SAM vision     ``Wqkv``, ``qkv``                q, k, v thirds
attention
GPTNeoX, Bloom, Persimmon,         ``query_key_value``,             ``[heads, 3, d]``
MiniMaxLightningAttention          ``qkv_proj``
CodeGenAttention                   ``qkv_proj``                     4 partitions of q, v, k
FalconAttention                    ``query_key_value``              per head, per kv group, or
                                                                    q heads then k, v
JetMoeAttention                    ``kv_proj``                      k, v halves
Qwen3-Next, Qwen3.5 attention      ``q_proj``                       ``[heads, 2, d]``: q, gate
Qwen3NextGatedDeltaNet             ``in_proj_qkvz``, ``in_proj_ba`` per key head q, k, v, z; b, a
Qwen3_5GatedDeltaNet               ``in_proj_qkv``; ``in_proj_z/b/a``  q, k, v; one map each
xLSTMLayer, xLSTMFeedForward       ``qkv_opreact``, ``ifgate_preact``,  q, k, v, o; i, f;
                                   ``proj_up_gate_z``               gate, z
Phi3MLP, ModernBertMLP, Zamba2MLP  ``gate_up_proj``, ``Wi``,        gate, up halves
                                   adapters
Mamba2, Falcon-H1 mixers           ``in_proj``                      z, x, B, C, dt
Mamba, FalconMamba, Jamba mixers   ``in_proj``, ``x_proj``          x, z halves; dt, B, C
Llama4TextExperts                  ``gate_up_proj``, ``down_proj``  ``[E, in, out]``, halves
JetMoeMoE, JetMoeMoA               ``input_linear``,                ``[E, out, in]``; gate, up
                                   ``output_linear``                halves in the MLP
LongcatFlash, Step3p7 experts      ``gate_up_proj``, ``down_proj``  ``[E, out, in]``, halves
InklingSharedExperts               ``gate/up/down_proj``            ``[n, out, in]`` stacks
DbrxExpertGLU                      ``w1``, ``v1``, ``w2``           E fused experts; w2
                                                                    ``[in, out]``
Gemma 3, T5Gemma 2 projectors      ``mm_input_projection_weight``   ``x @ W``: ``[in, out]``
SAM-style attention (use_rel_pos)  ``rel_pos_h``, ``rel_pos_w``     lookup tables
Deformable DETR and kin            ``level_embed``                  lookup table
=================================  ===============================  ==========================
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from muon_dist.routing.layouts import (
    Layout,
    ModuleRule,
    declared_experts,
    interleaved,
    latent_attention,
    parts,
    size,
)
from muon_dist.routing.structure import is_transposed_linear

# How far above its owner a module class may speak for a parameter (JetMoeMoE speaks for
# input_linear.weight, Zamba2MLP for gate_up_proj_adapter_list.0.1.weight).
_DEPTH = 4


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0]


def _halves(why: str) -> ModuleRule:
    def rule(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
        return parts([shape[0] // 2] * 2, shape[0], why)

    return rule


def _one_map(why: str) -> ModuleRule:
    def rule(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
        return Layout({}, why)

    return rule


def _table(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    return Layout({}, f"{type(module).__name__}: lookup table (indexed, not multiplied)", True)


def _rel_pos(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    return _table(module, shape) if getattr(module, "use_rel_pos", False) else None


def _gpt2_c_attn(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    split = size(module, "split_size")
    rows = shape[1]  # Conv1D: [in, out]
    if split is None or rows % split:
        return None
    found = parts([split] * (rows // split), rows, "c_attn(x).split(split_size)")
    return Layout({"transposed": True, **found.options}, found.reason) if found else None


def _bigcode_c_attn(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    d, embed = size(module, "head_dim"), size(module, "embed_dim")
    if d is None or embed is None or getattr(module, "is_cross_attention", False):
        return None
    if getattr(module, "multi_query", False):
        return parts([embed, d, d], _rows(shape), "multi-query: q heads, k, v")
    return interleaved([d, d, d], _rows(shape), "[heads, 3, d]: q, k, v per head")


def _phi3_qkv(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    d, heads = size(module, "head_dim"), size(module, "num_attention_heads")
    kv = size(module, "num_key_value_heads")
    if d is None or heads is None or kv is None:
        return None
    return parts([heads * d, kv * d, kv * d], _rows(shape), "q, k, v blocks")


def _dbrx_qkv(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    d, hidden = size(module, "head_dim"), size(module, "hidden_size")
    kv = size(module, "num_key_value_heads")
    if d is None or hidden is None or kv is None:
        return None
    return parts([hidden, kv * d, kv * d], _rows(shape), "q, k, v blocks")


def _thirds(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    return parts([shape[0] // 3] * 3, shape[0], "q, k, v thirds")


def _per_head_qkv(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    d = size(module, "head_dim", "head_size")
    return None if d is None else interleaved([d, d, d], _rows(shape), "[heads, 3, d]: q, k, v")


def _codegen_qkv(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    partitions = 4  # CodeGenAttention.forward: mp_num = 4
    local, odd = divmod(shape[0], 3 * partitions)
    if odd:
        return None
    return parts([local] * 3, shape[0], "4 partitions of q, v, k", partitions)


def _falcon_qkv(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    heads, d = size(module, "num_heads"), size(module, "head_dim")
    if heads is None or d is None:
        return None
    if getattr(module, "new_decoder_architecture", False):
        kv = size(module, "num_kv_heads") or heads
        if heads % kv:
            return None
        return interleaved([heads // kv * d, d, d], _rows(shape), "per kv group: q heads, k, v")
    if getattr(module, "multi_query", False):
        return parts([heads * d, d, d], _rows(shape), "q heads, k, v")
    return interleaved([d, d, d], _rows(shape), "[heads, 3, d]: q, k, v")


def _gated_q(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    d, heads = size(module, "head_dim"), size(module, "num_attention_heads")
    if d is None or heads is None or shape[0] != 2 * heads * d:
        return Layout({}, f"{type(module).__name__}: q_proj is the query alone")
    return interleaved([d, d], shape[0], "[heads, 2, d]: q, gate per head")


def _linear_heads(module: nn.Module) -> tuple[int, int, int, int] | None:
    found = [size(module, n) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    if any(v is None for v in found):
        return None
    nk, nv, dk, dv = (int(v) for v in found if v is not None)
    return (nk, nv, dk, dv) if nv % nk == 0 else None


def _qkvz(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    heads = _linear_heads(module)
    if heads is None:
        return None
    nk, nv, dk, dv = heads
    r = nv // nk
    return parts([dk, dk, r * dv, r * dv], shape[0], "per key head q, k, v, z", nk)


def _ba(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    heads = _linear_heads(module)
    if heads is None:
        return None
    r = heads[1] // heads[0]
    return parts([r, r], shape[0], "per key head b, a", heads[0])


def _qkv_dims(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    key, value = size(module, "key_dim"), size(module, "value_dim")
    if key is None or value is None:
        return None
    return parts([key, key, value], shape[0], "q, k, v blocks")


def _xlstm_qkvo(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    qk, v = size(module, "qk_dim"), size(module, "v_dim")
    if qk is None or v is None:
        return None
    return parts([qk, qk, v, v], shape[0], "q, k, v, o blocks")


def _ssd_in_proj(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    inner, heads = size(module, "intermediate_size"), size(module, "num_heads")
    groups, state = size(module, "n_groups"), size(module, "ssm_state_size")
    if inner is None or heads is None or groups is None or state is None:
        return None
    sizes = [inner, inner, groups * state, groups * state, heads]
    return parts(sizes, shape[0], "z, x, B, C, dt")


def _x_proj(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
    rank, state = size(module, "time_step_rank"), size(module, "ssm_state_size")
    if rank is None or state is None:
        return None
    return parts([rank, state, state], shape[0], "dt, B, C")


def _stack(why: str, halves: bool = False, transposed: bool = False) -> ModuleRule:
    """An expert stack ``[E, out, in]`` (``[E, in, out]`` if ``transposed``), its outputs
    cut into gate and up halves if ``halves``."""

    def rule(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
        if len(shape) != 3:
            return None
        options = {"experts": True, **({"transposed": True} if transposed else {})}
        if not halves:
            return Layout(options, why)
        rows = shape[2] if transposed else shape[1]
        found = parts([rows // 2] * 2, rows, "gate and up halves")
        return Layout({**options, **found.options}, f"{why}; {found.reason}") if found else None

    return rule


def _dbrx_experts(transposed: bool) -> ModuleRule:
    def rule(module: nn.Module, shape: tuple[int, ...]) -> Layout | None:
        experts = size(module, "moe_num_experts")
        if experts is None or shape[0] % experts:
            return None
        options = {"num_experts": experts, **({"transposed": True} if transposed else {})}
        why = f"{experts} fused experts [E*m, n]" + ("; x @ w2[e] reads [in, out]" * transposed)
        return Layout(options, why)

    return rule


_QKV_WEIGHT = r"(query_key_value|qkv_proj)\.weight"
_GPT2_COPIES = ("GPT2Attention", "ImageGPTAttention", "DecisionTransformerGPT2Attention")
_LEVEL_TABLES = (
    "DeformableDetrModel",
    "GroundingDinoModel",
    "MMGroundingDinoModel",
    "OneFormerPixelDecoder",
    "Mask2FormerPixelDecoder",
)
_ATTENTION_GATED_Q = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention")
_MAMBA = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")

FAMILY_RULES: Mapping[str, Mapping[str, ModuleRule]] = {
    **{cls: {r"c_attn\.weight": _gpt2_c_attn} for cls in _GPT2_COPIES},
    "GPTBigCodeAttention": {r"c_attn\.weight": _bigcode_c_attn},
    "Phi3Attention": {r"qkv_proj\.weight": _phi3_qkv},
    "Phi3MLP": {r"gate_up_proj\.weight": _halves("gate_up_proj(x).chunk(2)")},
    "DbrxAttention": {r"Wqkv\.weight": _dbrx_qkv},
    "DbrxExpertGLU": {r"[wv]1": _dbrx_experts(False), r"w2": _dbrx_experts(True)},
    "ModernBertAttention": {r"Wqkv\.weight": _thirds},
    **{cls: {r"qkv\.weight": _thirds} for cls in ("SamVisionAttention", "SamHQVisionAttention")},
    "ModernBertMLP": {r"Wi\.weight": _halves("Wi(x).chunk(2): input, gate")},
    **{
        cls: {_QKV_WEIGHT: _per_head_qkv}
        for cls in (
            "GPTNeoXAttention",
            "BloomAttention",
            "PersimmonAttention",
            "MiniMaxLightningAttention",
        )
    },
    "CodeGenAttention": {r"qkv_proj\.weight": _codegen_qkv},
    "FalconAttention": {r"query_key_value\.weight": _falcon_qkv},
    "JetMoeAttention": {r"kv_proj\.weight": _halves("kv_proj(x).chunk(2): k, v")},
    **{cls: {r"q_proj\.weight": _gated_q} for cls in _ATTENTION_GATED_Q},
    **{
        cls: {r"in_proj_qkvz\.weight": _qkvz, r"in_proj_ba\.weight": _ba}
        for cls in ("Qwen3NextGatedDeltaNet",)
    },
    **{
        cls: {
            r"in_proj_qkv\.weight": _qkv_dims,
            r"in_proj_[zba]\.weight": _one_map(f"{cls}: one map each (z, b, a)"),
        }
        for cls in ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
    },
    "xLSTMLayer": {
        r"qkv_opreact\.weight": _xlstm_qkvo,
        r"ifgate_preact\.weight": _halves("ifgate_preact(x): i, f per head"),
    },
    "xLSTMFeedForward": {
        r"proj_up_gate_z\.weight": _halves("proj_up_gate_z(x): gate, z"),
        r"proj_up(_gate)?\.weight": _one_map("xLSTMFeedForward: one map each (gate, up)"),
    },
    "Zamba2MLP": {
        r"gate_up_proj\.weight": _halves("gate_up_proj(x).chunk(2)"),
        r"gate_up_proj_adapter_list\.\d+\.1\.weight": _halves("adapter added to gate, up"),
    },
    **{cls: {r"in_proj\.weight": _ssd_in_proj} for cls in ("Mamba2Mixer", "FalconH1Mixer")},
    **{
        cls: {r"in_proj\.weight": _halves("in_proj(x).chunk(2): x, z"), r"x_proj\.weight": _x_proj}
        for cls in _MAMBA
    },
    "Llama4TextExperts": {
        r"gate_up_proj": _stack("Llama4TextExperts: bmm(x, W) [E, in, out]", True, True),
        r"down_proj": _stack("Llama4TextExperts: bmm(h, W) [E, in, out]", transposed=True),
    },
    "JetMoeMoE": {
        r"input_linear\.weight": _stack("JetMoeMoE experts [E, out, in]", halves=True),
        r"output_linear\.weight": _stack("JetMoeMoE experts [E, out, in]"),
    },
    "JetMoeMoA": {r"(input|output)_linear\.weight": _stack("JetMoeMoA experts [E, out, in]")},
    **{
        cls: {
            r"gate_up_proj": _stack(f"{cls} [E, out, in]", halves=True),
            r"down_proj": _stack(f"{cls} [E, out, in]"),
        }
        for cls in ("LongcatFlashExperts", "Step3p7Experts")
    },
    "InklingSharedExperts": {r"(gate|up|down)_proj": _stack("InklingSharedExperts [n, out, in]")},
    **{
        cls: {
            r"mm_input_projection_weight": lambda m, s: Layout(
                {"transposed": True}, "matmul(x, W) reads [in, out]"
            )
        }
        for cls in ("Gemma3MultiModalProjector", "T5Gemma2MultiModalProjector")
    },
    **{cls: {r"level_embed": _table} for cls in _LEVEL_TABLES},
    **{
        cls: {r"weight": _one_map(f"{cls}: router, linear(x, weight)")}
        for cls in ("DeepseekV3TopkRouter", "Mistral4TopkRouter")
    },
}
"""module class name -> {parameter path inside it (regex, whole match) -> rule}."""

KNOWN_BLOCKS = frozenset(
    {
        "T5Attention",
        "T5DenseActDense",
        "T5DenseGatedActDense",
        "SwitchTransformersAttention",
        "SwitchTransformersDenseActDense",
        "SwitchTransformersTop1Router",
        "NllbMoeAttention",
        "NllbMoeDenseActDense",
        "NllbMoeTop2Router",
        "JetMoeTopKGating",
        "Mistral4MLP",
        "BartAttention",
        "GPT2MLP",
        "DecisionTransformerGPT2MLP",
        "SiglipAttention",
        "SiglipMLP",
        "CLIPAttention",
        "CLIPMLP",
        "DbrxRouter",
        "MultiheadAttention",  # out_proj: linear(x, W) in F.multi_head_attention_forward
    }
)
"""Blocks whose forward applies each of its plain linear layers whole, as ``linear(x, W)``
(written from each forward, transformers 5.23: attention projections viewed per head and
joined again, MLP and router layers), where the forward often cannot be observed (T5,
GPT-2, DBRX and the MoE encoder-decoders read values: ``.item()``, ``nonzero``; at a
published size built on meta, or sharded by FSDP2, there is nothing real to run them
on), and vision towers a forward often does not reach (SigLIP's, CLIP's). With the
classes of the family table, whose rules name every linear layer they cut, a plain
``nn.Linear`` inside one is settled: one map, no warning."""


def plain_linear(module: nn.Module | None) -> bool:
    """An ``nn.Linear`` itself (not a subclass, whose forward may apply its weight
    otherwise) or transformers' ``Conv1D``."""
    linear = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)
    return module is not None and (type(module) in linear or is_transposed_linear(module))


def known_block(modules: Mapping[str, nn.Module], name: str) -> str | None:
    """The class of the nearest module above parameter ``name`` (within a few levels)
    whose forward is known: a class of the family table or of :data:`KNOWN_BLOCKS`, latent
    attention, or an experts module declaring its layout; None where there is none."""
    path = name.split(".")
    for depth in range(2, min(_DEPTH, len(path)) + 1):
        module = modules.get(".".join(path[:-depth]))
        if module is None:
            continue
        classes = {c.__name__ for c in type(module).__mro__}
        if classes & (FAMILY_RULES.keys() | KNOWN_BLOCKS):
            return type(module).__name__
        if size(module, "kv_lora_rank") and size(module, "qk_rope_head_dim"):
            return type(module).__name__
    return None


def _credited(layout: Layout | None, cls: str) -> Layout | None:
    """The layout with its class named first in the audit's reason."""
    if layout is None or layout.reason.startswith(cls):
        return layout
    return Layout(layout.options, f"{cls}: {layout.reason}", layout.table)


def module_layout(
    modules: Mapping[str, nn.Module], name: str, shape: tuple[int, ...]
) -> Layout | None:
    """The layout the nearest module class (or a base class: ``SamVisionSdpaAttention``
    is a ``SamVisionAttention``) with a rule for ``name`` gives it, or one its
    owner declares (experts, latent attention, ``use_rel_pos`` tables); None without
    evidence."""
    path = name.split(".")
    for depth in range(1, min(_DEPTH, len(path)) + 1):
        module = modules.get(".".join(path[:-depth]))
        relative = ".".join(path[-depth:])
        cls = next((c.__name__ for c in type(module).__mro__ if c.__name__ in FAMILY_RULES), None)
        for pattern, rule in FAMILY_RULES.get(cls or "", {}).items():
            if module is not None and re.fullmatch(pattern, relative):
                return _credited(rule(module, shape), type(module).__name__)
    owner = modules.get(".".join(path[:-1]))
    attention = modules.get(".".join(path[:-2])) if len(path) > 1 else None
    if attention is not None and (found := latent_attention(attention, path[-2:], shape[0])):
        return found
    if owner is None:
        return None
    if re.fullmatch(r"rel_pos_[hw]", path[-1]):  # SAM's vision attention and its copies
        return _rel_pos(owner, shape)
    return declared_experts(owner, path[-1], shape)
