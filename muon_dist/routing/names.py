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
