"""What a model's structure says about a parameter, and what it only suggests.

Evidence: the owning module's type (``nn.Linear`` is ``[out, in]``, transformers' ``Conv1D``
``[in, out]``, convolutions are not hidden matrices). Suggestions, which the router turns
into proposals and warnings but never into a split or an orientation: the shapes beside a
parameter (an expert container's stacks share their hidden size; a fused input projection
is twice as wide as the output projection's input), config sums (a projection whose
outputs add up to config dimensions could be fused) and names. Everything here reads
shapes, types and configs, never values, so every rank agrees.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ViewOptions = dict[str, Any]
"""Muon group options that shape a parameter's matrix view: ``split_sizes``,
``split_groups``, ``transposed``, ``experts``, ``num_experts``, ``muon_mode``."""

_HIDDEN = ("hidden_size", "d_model", "n_embd")
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
_KV_HEADS = ("num_key_value_heads", "kv_n_heads", "num_kv_heads")
_WIDTHS = (
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "intermediate_size_mlp",
)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# Nested sub-configs that hold dimensions (DBRX's attn_config and ffn_config).
_SUB_CONFIGS = ("attn_config", "ffn_config", "text_config")
# Parameters of state-space mixers (Mamba, Mamba2, Jamba, gated delta nets): decay rates,
# skip gains and step biases, not matrices of a linear map.
STATE_SPACE_NAMES = frozenset({"A_log", "D", "dt_bias"})
# Path parts that say which of two equally good config matches a projection is.
_ATTENTION_PATH = re.compile(r"attn|attention", re.IGNORECASE)
_MLP_PATH = re.compile(r"mlp|ffn|feed_forward|expert", re.IGNORECASE)


def hf_config(model: nn.Module) -> Any:
    """A Hugging Face model's config (``model.config`` with a ``model_type``), or None."""
    config = getattr(model, "config", None)
    return config if isinstance(getattr(config, "model_type", None), str) else None


def positive_ints(obj: Any, names: Iterable[str]) -> list[int]:
    """The positive integer values (or list items) of ``obj``'s attributes ``names``."""
    found = []
    for name in names:
        value = getattr(obj, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return found


@dataclass(frozen=True)
class ConfigDims:
    """The dimensions of a model's config that fused projections are sums of."""

    hidden: frozenset[int] = frozenset()
    qkv: tuple[tuple[int, int, int], ...] = ()  # (q, k, v) output sizes
    widths: frozenset[int] = frozenset()  # MLP and expert widths
    experts: int | None = None
    model_type: str | None = None

    @classmethod
    def of(cls, config: Any) -> ConfigDims:
        if config is None:
            return cls()
        sources = [config, *(getattr(config, s, None) for s in _SUB_CONFIGS)]
        sources = [s for s in sources if s is not None]

        def ints(names: Sequence[str]) -> list[int]:
            return [v for s in sources for v in positive_ints(s, names)]

        hidden, heads = ints(_HIDDEN), ints(_HEADS)
        kv_heads = ints(_KV_HEADS) + heads + ([1] if getattr(config, "multi_query", False) else [])
        head_dims = set(ints(("head_dim",))) | {h // n for h in hidden for n in heads if h % n == 0}
        qkv = {(n * d, k * d, k * d) for n in heads for k in kv_heads for d in head_dims}
        experts = ints(_EXPERTS)
        return cls(
            frozenset(hidden),
            tuple(sorted(qkv)),
            frozenset(ints(_WIDTHS)),
            experts[0] if experts else None,
            config.model_type,
        )

    def fused_split(self, name: str, out_dim: int, in_dim: int) -> tuple[list[int], str] | None:
        """How a projection ``in_dim -> out_dim`` of a hidden state could be fused, by the
        config: a proposal for the audit, never a split (an MLA ``q_proj`` or two shared
        experts add up by coincidence).

        Its outputs could be fused when they add up to q, k and v heads on an attention
        path or to twice an MLP width (gate and up) on an MLP path (LFM2's conv ``in_proj``
        is B, C, x: neither), and are neither the hidden size nor a width of their own. When
        both sums match, the module path (attention or MLP) decides; when it cannot, None.
        """
        if in_dim not in self.hidden or out_dim in self.hidden or out_dim in self.widths:
            return None
        found: dict[str, tuple[list[int], str]] = {}
        path = name.rsplit(".", 1)[0]
        for q, k, v in self.qkv if _ATTENTION_PATH.search(path) else ():  # LFM2's B, C, x
            if q + k + v == out_dim:
                found["attention"] = ([q, k, v], f"q {q} + k {k} + v {v}")
        for width in sorted(self.widths) if _MLP_PATH.search(path) else ():
            if 2 * width == out_dim:
                found["mlp"] = ([width, width], f"gate {width} + up {width}")
        if len(found) == 2:
            attention, mlp = bool(_ATTENTION_PATH.search(path)), bool(_MLP_PATH.search(path))
            if attention == mlp:
                return None
            kept = "attention" if attention else "mlp"
            found = {kept: found[kept]}
        if not found:
            return None
        sizes, text = next(iter(found.values()))
        return sizes, f"the config ({out_dim} = {text})"


# Name parts that suggest several matrices fused into one parameter, and those that also
# say how many (q, k, v; gate, up).
_FUSED_HINT = re.compile(
    r"gate_up|up_gate|qkv|w13|w1w3|w12|mlp1_weight|query_key_value|c_attn|in_proj|x_proj",
    re.IGNORECASE,
)
_NAMED_PARTS = (
    (re.compile(r"qkv|query_key_value", re.I), 3),
    (re.compile(r"gate_up|up_gate|w13|w1w3", re.I), 2),
)


def _leaf_module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def suggests_fusion(name: str) -> bool:
    """Whether a parameter's own name (not its module path) hints at fused matrices."""
    return _FUSED_HINT.search(_leaf_module(name)) is not None


def named_parts(name: str, rows: int) -> list[int] | None:
    """Equal parts a name counts (``qkv``: three, ``gate_up``: two), where they divide."""
    for pattern, count in _NAMED_PARTS:
        if pattern.search(_leaf_module(name)) and rows % count == 0:
            return [rows // count] * count
    return None


@dataclass(frozen=True)
class Stacks:
    """The 3-D stacks of one expert container, read together: the storage orientation
    (``[E, in, out]`` or ``[E, out, in]``) and the fused gate and up their shapes suggest,
    for the warning about a container no class describes."""

    in_out: bool | None  # None: the shapes do not tell
    fused: frozenset[str] = field(default_factory=frozenset)  # leaf names
    hidden: int | None = None

    @classmethod
    def of(cls, params: Sequence[tuple[str, torch.Tensor]], hidden: frozenset[int]) -> Stacks:
        shapes = {n: (int(p.shape[1]), int(p.shape[2])) for n, p in params if p.ndim == 3}
        candidates = set(hidden)
        if not candidates and shapes:  # no config: the size every stack shares
            common = set.intersection(*({a, b} for a, b in shapes.values()))
            candidates = common if len(common) == 1 else set()
        if len(candidates) != 1:
            return cls(None)
        (h,) = candidates
        # Stacks with the hidden size first or last, and their other size.
        first = {n: b for n, (a, b) in shapes.items() if a == h and b != h}
        last = {n: a for n, (a, b) in shapes.items() if b == h and a != h}
        # A fused input projection is twice as wide as the output projection's input.
        fused_first = {n for n, w in first.items() if any(w == 2 * o for o in last.values())}
        fused_last = {n for n, w in last.items() if any(w == 2 * o for o in first.values())}
        if fused_first and not fused_last:
            return cls(True, frozenset(fused_first), h)  # inputs read [E, H, out]
        if fused_last and not fused_first:
            return cls(False, frozenset(fused_last), h)  # inputs read [E, out, H]
        # Input projections (gate, up) outnumber the output projection.
        if len(last) > len(first):
            return cls(False, frozenset(), h)
        if len(first) > len(last) and last:
            return cls(True, frozenset(), h)
        return cls(None, frozenset(), h)


def matrix_sides(shape: Sequence[int], muon_mode: str, stacked: bool) -> tuple[int, int]:
    """The sides of each matrix Muon would see in a parameter of ``shape``: the last two of
    a 2-D weight or a stack, ``[out, prod(rest)]`` flattened, or one matrix per leading
    index ("slice")."""
    if len(shape) == 2 or stacked:
        return int(shape[-2]), int(shape[-1])
    if muon_mode == "slice":
        return int(shape[1]), math.prod(int(s) for s in shape[2:])
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def common_input_width(shapes: Iterable[Sequence[int]]) -> int | None:
    """The input size most 2-D weights of a model read (their last dim), where one size is
    the most common and at least two weights share it: its hidden size, for a model with
    neither a config nor embeddings."""
    counts = Counter(int(s[-1]) for s in shapes if len(s) == 2)
    ranked = counts.most_common(2)
    if not ranked or ranked[0][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return None
    return ranked[0][0]


def is_conv(module: nn.Module | None) -> bool:
    return isinstance(module, nn.modules.conv._ConvNd)


def is_transposed_linear(module: nn.Module | None) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and its descendants): a linear layer whose weight is
    stored ``[in, out]`` and applied as ``x @ W``."""
    if module is None:
        return False
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def linear_shape(module: nn.Module | None, shape: tuple[int, ...]) -> tuple[int, int, bool]:
    """``(out, in, transposed)`` of a 2-D weight as its module applies it."""
    if is_transposed_linear(module):
        return shape[1], shape[0], True
    return shape[0], shape[1], False
