"""The forward's word against the family table's: observation wins, and where the two
disagree one warning names the parameter, both layouts and the keyword that pins either.
Where neither settles a parameter, the warning gives the one argument that does.
"""

from __future__ import annotations

from typing import Any

from muon_dist.routing.decision import Route, shape_text
from muon_dist.routing.layouts import Layout
from muon_dist.routing.names import name_regex
from muon_dist.routing.observation import Observation
from muon_dist.routing.structure import ViewOptions

# The options an observation of a 2-D matrix settles (the rest: experts, expert counts).
OBSERVED_KEYS = ("split_sizes", "split_groups", "transposed")


def non_matrix(seen: Observation | None) -> Route | None:
    """The AdamW route of a parameter its forward shows is a table or a head."""
    if seen is None or seen.kind not in ("table", "head"):
        return None
    return Route(
        "adamw", f"{'lookup table' if seen.kind == 'table' else 'output head'} ({seen.reason})"
    )


def settled(seen: Observation | None) -> Observation | None:
    """The observation of a 2-D matrix where it settles its view, else None."""
    return seen if seen is not None and seen.kind == "matrix" else None


def _pinned(options: ViewOptions, rows: int) -> dict[str, Any]:
    """The ``fused=`` value that pins a layout (a whole matrix: one part)."""
    pinned = {k: options[k] for k in OBSERVED_KEYS if k in options}
    return pinned if "split_sizes" in pinned else {**pinned, "split_sizes": [rows]}


def disagreement(
    name: str, shape: tuple[int, ...], layout: Layout, seen: Observation
) -> str | None:
    """The warning where the family table and the forward read a parameter differently."""
    table = {k: layout.options[k] for k in OBSERVED_KEYS if k in layout.options}
    if layout.table:
        table_text = "a lookup table (AdamW)"
    elif table == seen.options:
        return None
    else:
        table_text = str(table) if table else "one whole matrix"
    regex = name_regex(name)
    rows = shape[1] if seen.options.get("transposed") else shape[0]
    pin_seen = _pinned(seen.options, rows)
    pin_table = (
        f"overrides={{{regex!r}: 'adamw'}}"
        if layout.table
        else f"fused={{{regex!r}: {_pinned(table, shape[1] if table.get('transposed') else rows)}}}"
    )
    return (
        f"{regex} ({shape_text(shape)}): its forward reads it as {seen.text()} "
        f"({seen.reason}), the family table as {table_text} ({layout.reason}); routed as the "
        f"forward reads it. To pin that and silence this, pass fused={{{regex!r}: "
        f"{pin_seen}}}; to route it as the table says, pass {pin_table}"
    )


def untraceable(name: str, shape: tuple[int, ...], seen: Observation) -> str:
    """The warning for a matrix whose forward cuts it in a way no view option says."""
    regex = name_regex(name)
    rows = shape[1] if seen.options.get("transposed") else shape[0]
    return (
        f"{regex} ({shape_text(shape)}): its forward cuts its outputs in a way no "
        f"split_sizes/split_groups describes ({seen.reason}): orthogonalized whole. "
        f"Pass fused={{{regex!r}: {{'split_sizes': [{rows}]}}}} to keep it whole and "
        f"silence this"
    )


def tensor_route(name: str, shape: tuple[int, ...], seen: Observation | None) -> Route:
    """A >2-D tensor that is neither a convolution nor an expert stack: AdamW. Where its
    forward reads it as matrices, the warning gives the one override that puts it on Muon
    as read; a table or head stays silent; unreached, the warning asks for inputs."""
    regex = name_regex(name)
    reason = f"{len(shape)}-D tensor"
    if seen is not None and seen.kind in ("slice", "flat"):
        guess = (
            f"{regex} ({shape_text(shape)}) is {seen.reason.split(': ', 1)[1]} by its "
            f"forward, but is neither a convolution nor an expert stack: it goes to "
            f"AdamW. To orthogonalize it as read, pass overrides={{{regex!r}: "
            f"'muon:{seen.kind}'}}"
        )
        return Route("adamw", f"{reason}, {seen.reason}", guess=guess)
    if seen is not None:
        return Route("adamw", f"{reason}, not a stack of matrices ({seen.reason})")
    guess = (
        f"{regex} ({shape_text(shape)}) is neither a convolution nor an expert stack, and "
        f"no forward reached it: it goes to AdamW. Pass example_inputs= that reach it to "
        f"param_groups, and its forward will say how it is read"
    )
    return Route("adamw", f"unknown {reason}", guess=guess)


def unobserved(
    name: str, shape: tuple[int, ...], transposed: bool, why: str, inputs: bool, bare: bool
) -> str:
    """The warning for a Muon matrix that neither its forward (``why`` it said nothing;
    ``inputs``: other inputs may reach it) nor a module class settles. A ``bare`` parameter
    (not the weight of a linear module: a query, latent or position table) is proposed for
    AdamW with the one ``overrides=`` to paste; a linear module's weight gets the one
    ``fused=`` that pins the route taken (one whole matrix); and, where inputs may reach it,
    ``example_inputs=`` that let its forward settle the route instead (a table or a head to
    AdamW, a cut matrix in parts). A clean log must not hide a table, a head or a fusion."""
    regex = name_regex(name)
    rows = shape[1] if transposed else shape[0]
    settle = (
        "; to have its forward settle the route instead, pass example_inputs= that reach it "
        "to param_groups"
        if inputs
        else ""
    )
    if bare:
        return (
            f"{regex} ({shape_text(shape)}) was not observed ({why}) and is not the weight "
            f"of a linear module: a learned table (queries, latents, positions) is indexed "
            f"or added, not multiplied, so it belongs on AdamW; it is on Muon as one whole "
            f"matrix until you pass overrides={{{regex!r}: 'adamw'}}{settle}"
        )
    return (
        f"{regex} ({shape_text(shape)}) was not observed ({why}) and no module class says "
        f"how it is applied: orthogonalized on Muon as one whole matrix. To pin that route "
        f"and silence this, pass fused={{{regex!r}: {{'split_sizes': [{rows}]}}}}{settle}"
    )
