"""Parameter names as routing patterns see them."""

from __future__ import annotations

import re

# Parts that wrappers (torch.compile, activation checkpointing, FSDP1, DDP) insert into names.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def normalize_fqn(name: str) -> str:
    """Strip wrapper-inserted name parts so routing patterns see the model's own names."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def name_regex(name: str) -> str:
    """A regex matching ``name`` at the end of a parameter name, layer numbers generalised."""
    return re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


_DOT = r"\."


def merged_regex(patterns: list[str]) -> str:
    """One regex matching exactly what each of ``patterns`` (from :func:`name_regex`)
    matches: their common leading and trailing name parts around an alternation of the
    parts between (``a\\.(q|k)_proj\\.weight$`` for two projections)."""
    unique = list(dict.fromkeys(patterns))
    if len(unique) == 1:
        return unique[0]
    if all(p.endswith("$") for p in unique):
        return merged_regex([p[:-1] for p in unique]) + "$"
    split = [p.split(_DOT) for p in unique]
    shortest = min(len(parts) for parts in split)
    head = 0
    while head < shortest - 1 and len({parts[head] for parts in split}) == 1:
        head += 1
    tail = 0
    while tail < shortest - 1 - head and len({parts[-1 - tail] for parts in split}) == 1:
        tail += 1
    middles = [_DOT.join(parts[head : len(parts) - tail]) for parts in split]
    if any(not m for m in middles):
        return "(" + "|".join(unique) + ")"
    joined = [*split[0][:head], "(" + "|".join(dict.fromkeys(middles)) + ")"]
    return _DOT.join(joined + (split[0][len(split[0]) - tail :] if tail else []))
