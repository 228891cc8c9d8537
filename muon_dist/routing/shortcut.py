"""What a traced repeated block took and gave, so that its untraced twins need not run.

On the meta device a twin's forward computes nothing but shapes: called as its traced twin
was, it gives what that twin gave. A call's inputs are compared leaf by leaf (tensors by
type, shape, dtype, device and strides; ``None``, bools, numbers and strings by value;
anything else, a cache passed to every layer, by identity), and the answer is fresh meta
tensors laid out like the traced twin's outputs, an input where the traced twin handed one
back, and its plain values. A twin whose outputs are anything else (a parameter, an object
it made, a tensor off meta) runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

_PLAIN = (type(None), bool, int, float, str)


class _Layout(NamedTuple):
    """A tensor input as the shortcut compares it: no values, which meta has none of."""

    kind: type
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]


def _key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _Layout(type(leaf), leaf.shape, leaf.dtype, leaf.device, leaf.stride())
    return leaf


def _matches(key: Any, leaf: Any) -> bool:
    if isinstance(key, _Layout):
        return isinstance(leaf, torch.Tensor) and _key(leaf) == key
    if type(key) in _PLAIN:
        return type(leaf) is type(key) and bool(leaf == key)
    return leaf is key


@dataclass(frozen=True)
class Shown:
    """A traced call: its inputs' keys (taken before it ran: it may change them) and its
    output's tree, each leaf a meta tensor to lay out anew, a plain value, or (``origins``)
    the position of the input it handed back."""

    spec: TreeSpec
    keys: list[Any]
    out: TreeSpec
    leaves: list[Any]
    origins: list[int | None]

    @staticmethod
    def keys_of(inputs: Any) -> tuple[TreeSpec, list[Any]]:
        leaves, spec = tree_flatten(inputs)
        return spec, [_key(leaf) for leaf in leaves]

    @classmethod
    def of(
        cls,
        before: tuple[TreeSpec, list[Any]],
        inputs: Any,
        out: Any,
        parameter: Callable[[torch.Tensor], bool],
    ) -> Shown | None:
        """The call that took ``inputs`` (keyed ``before`` it ran) and gave ``out``; None
        where a twin's answer cannot be made from it: an output that is a ``parameter``
        (a twin must hand back its own) or anything but a meta tensor or a plain value."""
        given = tree_flatten(inputs)[0]
        leaves, out_spec = tree_flatten(out)
        origins: list[int | None] = []
        for leaf in leaves:
            origin = next((i for i, a in enumerate(given) if a is leaf), None)
            fresh = type(leaf) is torch.Tensor and leaf.is_meta and not parameter(leaf)
            if origin is None and not (fresh or type(leaf) in _PLAIN):
                return None
            origins.append(origin)
        return cls(before[0], before[1], out_spec, leaves, origins)

    def fits(self, given: list[Any], spec: TreeSpec) -> bool:
        """Whether a call's inputs (flattened: ``given``, ``spec``) are the traced call's."""
        return spec == self.spec and all(map(_matches, self.keys, given))

    def answer(self, given: list[Any]) -> Any:
        """What a twin gives, called on inputs that fit (flattened: ``given``)."""
        copies: dict[int, torch.Tensor] = {}  # a tensor given twice is made once
        made = []
        for leaf, origin in zip(self.leaves, self.origins, strict=True):
            if origin is not None:
                made.append(given[origin])
            elif isinstance(leaf, torch.Tensor):
                if id(leaf) not in copies:
                    copies[id(leaf)] = _laid_out(leaf)
                made.append(copies[id(leaf)])
            else:
                made.append(leaf)
        return tree_unflatten(made, self.out)


def _laid_out(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def watched(member: nn.Module, ours: object) -> bool:
    """Whether a hook would miss a twin's forward not run: a global module hook, or one on a
    module inside it other than ``ours`` (Transformers' output capture, installed during
    the forward, records each attention module's weights)."""
    if _global_forward_hooks or _global_forward_pre_hooks:
        return True
    for sub in member.modules():
        if sub is member:
            continue
        hooks = (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values())
        if any(getattr(h, "__self__", None) is not ours for h in hooks):
            return True
    return False
