"""How a module's forward reads one of its parameters (a :class:`Layout`), the helpers the
family table's rules build layouts with, and the layouts modules declare about themselves.

A split, an orientation or a table is taken only from evidence. The family table,
:mod:`muon_dist.routing.known_modules`, keys its rules by module class; this module holds
what those rules share (:func:`size`, :func:`parts`, :func:`interleaved`) and the layouts
that need no class name: transformers' ``@use_experts_implementation`` sets
``is_transposed``, ``is_concatenated`` and ``has_gate`` on every experts module it wraps
(:func:`declared_experts`); multi-head latent attention modules carry ``kv_lora_rank`` and
``qk_rope_head_dim`` (:func:`latent_attention`); torchtitan's fused layouts are read from
its owning modules' attributes (:func:`titan_layout`). Every size is read from the module
(its attributes, else its ``config``), never from shapes that happen to add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from muon_dist.routing.structure import ViewOptions, positive_ints


@dataclass(frozen=True)
class Layout:
    """How a module's forward reads one of its parameters: Muon view options (parts,
    ``transposed``, ``num_experts``, ``experts``), or ``table`` (indexed or added, not a
    linear map: AdamW); ``reason`` is what the audit shows."""

    options: ViewOptions = field(default_factory=dict)
    reason: str = ""
    table: bool = False


ModuleRule = Callable[[nn.Module, tuple[int, ...]], Layout | None]
"""``(module, stored shape) -> Layout`` for one parameter path inside a module class; None
where the module's sizes do not describe the shape (then no evidence)."""


def size(module: nn.Module, *names: str) -> int | None:
    """The first positive int among ``module``'s attributes ``names``, else its config's."""
    for source in (module, getattr(module, "config", None)):
        found = positive_ints(source, names) if source is not None else []
        if found:
            return found[0]
    return None


def parts(sizes: list[int], rows: int, why: str, groups: int = 1) -> Layout | None:
    """Parts ``sizes`` repeated ``groups`` times along ``rows`` outputs, if they tile it."""
    if not sizes or min(sizes) < 1 or sum(sizes) * groups != rows:
        return None
    options: ViewOptions = {"split_sizes": sizes}
    if groups > 1:
        options["split_groups"] = groups
    return Layout(options, why)


def interleaved(sizes: list[int], rows: int, why: str) -> Layout | None:
    """Parts ``sizes`` repeated along ``rows`` as often as they fit (per head, per group)."""
    if not sizes or min(sizes) < 1 or rows % sum(sizes):
        return None
    return parts(sizes, rows, why, rows // sum(sizes))


def declared_experts(owner: nn.Module, leaf: str, shape: tuple[int, ...]) -> Layout | None:
    """An experts module wrapped by transformers' ``use_experts_implementation``, which
    records its layout on the module: ``[E, in, out]`` when ``is_transposed``; a fused
    ``gate_up_proj`` cut into halves when ``is_concatenated``, alternating rows if not."""
    flags = {k: getattr(owner, k, None) for k in ("is_transposed", "is_concatenated", "has_gate")}
    if len(shape) != 3 or not all(isinstance(v, bool) for v in flags.values()):
        return None
    if leaf not in ("gate_up_proj", "up_proj", "down_proj"):
        return None
    options: ViewOptions = {"experts": True}
    stored = "[E, in, out]" if flags["is_transposed"] else "[E, out, in]"
    why = [f"{type(owner).__name__} declares {stored}"]
    if flags["is_transposed"]:
        options["transposed"] = True
    if leaf == "gate_up_proj" and flags["has_gate"]:
        rows = shape[2] if flags["is_transposed"] else shape[1]
        if flags["is_concatenated"]:
            fused = parts([rows // 2, rows // 2], rows, "gate and up halves")
        else:
            fused = interleaved([1, 1], rows, "gate and up alternate")
        if fused is None:
            return None
        options.update(fused.options)
        why.append(fused.reason)
    return Layout(options, "; ".join(why))


_LATENT = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def latent_attention(owner: nn.Module, tail: list[str], rows: int) -> Layout | None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi, Mistral 4): its projections are
    each one map (per head, the rotary and the other part of one query, joined again),
    whatever their widths add up to, but for ``kv_a_proj_with_mqa``, whose forward splits
    the latent kv from the rotary key, and ``kv_b_proj``, whose heads each split into a key
    part and a value: parts that never meet again."""
    if len(tail) != 2 or tail[1] != "weight" or tail[0] not in _LATENT:
        return None
    latent, rope = size(owner, "kv_lora_rank"), size(owner, "qk_rope_head_dim")
    if latent is None or rope is None:
        return None
    if tail[0] == "kv_a_proj_with_mqa":  # split([kv_lora_rank, rope]): latent kv, rope key
        return parts([latent, rope], rows, f"{type(owner).__name__}: latent kv, rope key")
    nope, value = size(owner, "qk_nope_head_dim"), size(owner, "v_head_dim")
    if tail[0] == "kv_b_proj" and nope is not None and value is not None:  # per head k, v
        found = interleaved([nope, value], rows, "per head: k (no rope), v")
        return _credit(found, owner) if found else None
    return Layout({}, f"{type(owner).__name__}: latent attention, one map per projection")


def _credit(layout: Layout, owner: nn.Module) -> Layout:
    return Layout(layout.options, f"{type(owner).__name__}: {layout.reason}")


def titan_layout(
    owner: nn.Module | None, grandparent: nn.Module | None, name: str, rows: int
) -> Layout | None:
    """torchtitan's fused layouts: GPT-OSS ``mlp1_weight_EGD`` (gate and up alternate, as
    its ``_EGD`` suffix declares) and ``FusedQKVLinear.wqkv`` (per key-value head,
    ``heads_per_kv`` query heads, k, v)."""
    if name.split(".")[-1] == "mlp1_weight_EGD":
        return interleaved([1, 1], rows, "torchtitan gpt_oss: gate, up alternate")
    if name.split(".")[-2:] != ["wqkv", "weight"] or not isinstance(owner, nn.Linear):
        return None
    per_kv = positive_ints(grandparent, ("heads_per_kv",))
    head_dim = positive_ints(grandparent, ("head_dim",))
    if not per_kv or not head_dim:
        return None
    sizes = [per_kv[0] * head_dim[0], head_dim[0], head_dim[0]]
    return interleaved(sizes, rows, "torchtitan FusedQKVLinear: per kv head q, k, v")
