"""What the routing proposes where no evidence settles a parameter: each proposal is a
line of the audit or of the one warning, with the exact keyword that settles it; none of
them changes a route. Config sums, names and the shapes beside a parameter only hint.
"""

from __future__ import annotations

from torch import nn

from muon_dist.routing.decision import shape_text
from muon_dist.routing.names import name_regex
from muon_dist.routing.structure import (
    ConfigDims,
    Stacks,
    ViewOptions,
    named_parts,
    suggests_fusion,
)


def proposal(
    dims: ConfigDims, name: str, shape: tuple[int, ...], transposed: bool
) -> tuple[str, str | None] | None:
    """Without evidence a matrix stays whole. Where the config's sizes add up to its
    outputs, or its name says how many parts it has, the audit proposes the ``fused=``
    that would split it; where its name suggests fusion, so does a warning."""
    rows, cols = (shape[1], shape[0]) if transposed else shape
    found = dims.fused_split(name, rows, cols)
    named = named_parts(name, rows)
    if found is not None:
        sizes, source = found
    elif named is not None:
        sizes, source = named, "its name"
    else:
        return None
    regex = name_regex(name)
    audit = f"whole: no module class says it is fused ({source} would cut it {sizes})"
    if not suggests_fusion(name):
        return audit, None
    guess = (
        f"{regex} ({shape_text(shape)}) is named like fused matrices and {source} would "
        f"cut it {sizes}, but neither its forward (not observed) nor a module class says "
        f"how it is cut: orthogonalized whole. If it is fused, pass fused={{{regex!r}: "
        f"{{'split_sizes': {sizes}}}}} (add 'split_groups' for parts interleaved per head); "
        f"to keep it whole and silence this, pass fused={{{regex!r}: {{'split_sizes': "
        f"[{rows}]}}}}"
    )
    return audit, guess


def stack_guess(
    stacks: Stacks, name: str, owner: nn.Module | None, shape: tuple[int, ...]
) -> str | None:
    """A stack without evidence is read ``[E, out, in]``, whole per expert; where its
    container's shapes suggest otherwise (the hidden size first, a gate+up twice the
    down projection's width) or cannot tell, the warning proposes the ``fused=``."""
    leaf = name.rpartition(".")[2]
    regex = name_regex(name)
    proposed: ViewOptions = {}
    if stacks.in_out:
        proposed["transposed"] = True
    if leaf in stacks.fused:
        rows = shape[2] if stacks.in_out else shape[1]
        proposed["split_sizes"] = [rows // 2, rows // 2]
    if proposed:
        return (
            f"{regex} ({shape_text(shape)}): its container's shapes suggest "
            f"{'[E, in, out]' if stacks.in_out else '[E, out, in]'}"
            f"{' with gate and up halves' if 'split_sizes' in proposed else ''}, but no "
            f"module class says so: read [E, out, in], whole per expert. If its forward "
            f"reads it so, pass fused={{{regex!r}: {proposed}}}"
        )
    siblings = sum(1 for p in owner.parameters(recurse=False) if p.ndim == 3) if owner else 0
    if stacks.in_out is None and shape[1] != shape[2] and siblings > 1:
        return (
            f"{regex} ({shape_text(shape)}): its container's shapes do not tell "
            f"[E, out, in] from [E, in, out]; read as [E, out, in]; pass fused="
            f"{{{regex!r}: {{'transposed': True}}}} if it is applied as x @ W[e]"
        )
    return None


def fused_experts(
    name: str, shape: tuple[int, ...], num_experts: int | None, config_experts: int | None
) -> tuple[ViewOptions, str] | str:
    """A raw 2-D weight ``[E*m, n]`` under an expert module: E experts where the caller
    says ``num_experts=E``; else one matrix, and a guess proposing E."""
    if num_experts is not None and shape[0] % num_experts == 0:
        return {"num_experts": num_experts}, f"{num_experts} fused experts [E*m, n] (num_experts)"
    hint = (
        f"; the config has {config_experts} experts: num_experts={config_experts}"
        if config_experts is not None and shape[0] % config_experts == 0
        else ""
    )
    return (
        f"{name_regex(name)} ({shape_text(shape)}) is a 2-D weight under an expert module, "
        f"orthogonalized as one matrix; pass num_experts=E if it stacks E experts [E*m, n]"
        f"{hint}"
    )
