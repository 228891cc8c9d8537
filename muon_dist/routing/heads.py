"""Embeddings and output heads, from the model's own API and structure.

A name proves nothing: RWKV, LED and ProphetNet call hidden layers ``output``, and
classifiers are called ``score``, ``decoder`` or ``bbox_predictor``. What counts: the
module's class (``nn.Embedding``), the model's own API (``get_input_embeddings()``,
``get_output_embeddings()``), the task head of a transformers model (outside its base
model: the last linear layer of each small head module), and name patterns only for
linear layers outside the numbered blocks (a top-level ``lm_head`` or ``output``), or
anywhere for patterns the caller passes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from muon_dist.routing.names import normalize_fqn
from muon_dist.routing.structure import is_transposed_linear

HEAD_NAMES = (r"(^|\.)(lm_head|output|head|classifier)$",)
# A task head has at most this many linear layers (DETR's box MLP has 3); a module outside
# the base model with more is something else (a vision tower, a multi-token predictor).
_HEAD_LAYERS = 4


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def _own(module: nn.Module | None) -> set[int]:
    return {id(p) for p in module.parameters(recurse=False)} if module is not None else set()


def _api(model: nn.Module, method: str) -> nn.Module | None:
    """``model.<method>()`` where the model has it and it returns a module."""
    getter = getattr(model, method, None)
    if not callable(getter):
        return None
    try:
        found = getter()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    return found if isinstance(found, nn.Module) else None


def task_heads(model: nn.Module) -> set[int]:
    """A transformers model's task head: outside its base model (``base_model_prefix``),
    each direct child (each item of a child list) with at most a few linear layers and no
    embedding gives its final linear layer (DETR's ``class_labels_classifier`` and the
    last layer of ``bbox_predictor``; a ``score``; an untied MLM ``decoder``)."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(base, nn.Module) or base is model:
        return set()
    heads: set[int] = set()
    for child in model.children():
        if child is base:
            continue
        listed = isinstance(child, (nn.ModuleList, nn.ModuleDict))
        for unit in child.children() if listed else [child]:
            last = _final_linear(unit)
            if last is not None:
                heads |= _own(last)
    return heads


def _final_linear(unit: nn.Module) -> nn.Module | None:
    """The last linear layer of a small head module, where nothing with parameters (a
    norm, as in ModernBERT's prediction head) comes after it; else None."""
    inner = list(unit.modules())
    places = [i for i, m in enumerate(inner) if _linear(m)]
    if not places or len(places) > _HEAD_LAYERS or any(isinstance(m, nn.Embedding) for m in inner):
        return None
    after = inner[places[-1] + 1 :]
    if any(next(m.parameters(recurse=False), None) is not None for m in after):
        return None
    return inner[places[-1]]


def _outside_blocks(name: str) -> bool:
    return not any(part.isdigit() for part in name.split("."))


def embedding_and_head_ids(
    model: nn.Module,
    head_patterns: Sequence[str] | None,
    embedding_patterns: Sequence[str],
) -> tuple[set[int], set[int]]:
    """Ids of the parameters of embedding tables, and of output heads. ``head_patterns``
    None: :data:`HEAD_NAMES`, only outside the numbered blocks; given: anywhere."""
    embeddings = _own(_api(model, "get_input_embeddings"))
    heads = _own(_api(model, "get_output_embeddings")) | task_heads(model)
    patterns = HEAD_NAMES if head_patterns is None else tuple(head_patterns)
    for raw_name, module in model.named_modules():
        name = normalize_fqn(raw_name)
        if isinstance(module, nn.Embedding):
            embeddings |= _own(module)
        elif _linear(module):
            if any(re.search(p, name) for p in patterns) and (
                head_patterns is not None or _outside_blocks(name)
            ):
                heads |= _own(module)
        elif any(re.search(p, name) for p in embedding_patterns):
            embeddings |= _own(module)
    return embeddings, heads
