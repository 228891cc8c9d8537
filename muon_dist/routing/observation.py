"""What one forward says about a parameter: a linear map (its orientation and parts), a
table, a head, or a stack of matrices; from the :class:`muon_dist.routing.trace.Record`.

Parts are the finest cut of the product's outputs that the forward makes and keeps: a
cut whose pieces are joined again into its source (rotary halves put back together, a
rotary part and a pass-through part) is no part. A product added to another parameter's
is followed no further (the sum carries the other's codes): unsettled. The cut must
repeat one pattern of contiguous blocks along the outputs (q, k, v blocks;
``[heads, 3, d]`` per head), or it is not traceable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muon_dist.routing.structure import ViewOptions
from muon_dist.routing.trace import Record


@dataclass(frozen=True)
class Observation:
    """``kind``: "matrix" (a linear map, view ``options``), "table", "head", "slice" or
    "flat" (how a >2-D tensor is read), "untraceable" (cut in no pattern of blocks) or
    "unsettled" (uses that say nothing for sure; ``reason`` says which)."""

    kind: str
    options: ViewOptions = field(default_factory=dict)
    reason: str = ""

    def text(self) -> str:
        """The layout in the words of a ``fused=`` value."""
        if self.kind != "matrix":
            return self.kind
        return str(self.options) if self.options else "one whole matrix"


def observation(record: Record, shape: tuple[int, ...], head: bool) -> Observation | None:
    """The observation of a parameter of ``shape`` from its record; None if unreached."""
    uses = record.uses
    if not uses:
        return None
    if len(shape) > 2:
        if head and uses == {"slice"}:  # one head per leading index (Moshi's lm_heads)
            return Observation("head", reason="observed: its product is the model's output")
        if len(uses) == 1 and uses <= {"slice", "flat"}:
            (use,) = uses
            return Observation(use, reason=f"observed: read as {_STACK_WORDS[use]}")
        return Observation("unsettled", reason=f"observed uses {sorted(uses)}")
    if uses == {"table"}:
        return Observation("table", reason="observed: indexed or added, never multiplied")
    if len(uses) != 1 or not uses <= {"rows", "columns"}:
        return Observation("unsettled", reason=f"observed uses {sorted(uses)}")
    if head:  # reached an output, even where it was added to another's later on
        return Observation("head", reason="observed: its product is the model's output")
    if record.merged:
        return Observation("unsettled", reason="its product is added to another's")
    transposed = uses == {"columns"}
    outputs = shape[1] if transposed else shape[0]
    found = parts(record, outputs)
    options: ViewOptions = {"transposed": True} if transposed else {}
    if found is None:
        return Observation("untraceable", options, "observed cuts that repeat no pattern")
    sizes, groups = found
    if len(sizes) > 1:
        options["split_sizes"] = sizes
        if groups > 1:
            options["split_groups"] = groups
    return Observation("matrix", options, _matrix_reason(transposed, sizes, groups))


_STACK_WORDS = {"slice": "one matrix per leading index", "flat": "one flattened matrix"}


def _matrix_reason(transposed: bool, sizes: list[int], groups: int) -> str:
    read = "x @ W" if transposed else "linear(x, W)"
    if len(sizes) == 1:
        return f"observed: {read}, one map"
    cut = "+".join(str(s) for s in sizes) + (f" x{groups}" if groups > 1 else "")
    return f"observed: {read}, cut {cut}"


def _kept_cuts(record: Record) -> list[tuple[frozenset[int], list[frozenset[int]]]]:
    """The cuts that no join puts back together (a join of exactly the cut's source)."""
    joined = {_closure(join, record.mixes) for join in record.joins}
    return [(whole, pieces) for whole, pieces in record.cuts.values() if whole not in joined]


def _closure(
    join: frozenset[int], mixes: list[tuple[frozenset[int], frozenset[int]]]
) -> frozenset[int]:
    """A join's features with those mixed elementwise into them before the join (rotary:
    ``cat(x1 * cos - x2 * sin, ...)`` holds the codes of x1 alone, but joins both)."""
    held = set(join)
    grown = True
    while grown:
        grown = False
        for a, b in mixes:
            if (a <= held) != (b <= held):
                held |= a | b
                grown = True
    return frozenset(held)


def parts(record: Record, outputs: int) -> tuple[list[int], int] | None:
    """``(split_sizes, split_groups)`` of the finest kept cut of ``outputs`` features;
    ``([outputs], 1)`` uncut; None where the blocks repeat no pattern."""
    kept = _kept_cuts(record)
    if not kept:
        return [outputs], 1
    labels = torch.zeros(outputs, dtype=torch.long)
    for whole, pieces in kept:  # each feature labelled by the piece of every cut it is in
        cut = torch.full((outputs,), -2, dtype=torch.long)
        cut[torch.tensor(sorted(whole), dtype=torch.long)] = -1
        for i, piece in enumerate(pieces):
            cut[torch.tensor(sorted(piece), dtype=torch.long)] = i
        pair = labels * (len(pieces) + 2) + (cut + 2)
        labels = torch.unique(pair, return_inverse=True)[1]
    return _pattern(labels.tolist())


def _runs(labels: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1] + 1)
        else:
            runs.append((label, 1))
    return runs


def _pattern(labels: list[int]) -> tuple[list[int], int] | None:
    """The most repeats of one period of distinct contiguous blocks that ``labels`` is."""
    n = len(labels)
    for groups in sorted((g for g in range(1, n + 1) if n % g == 0), reverse=True):
        period = n // groups
        first = labels[:period]
        if any(labels[g * period : (g + 1) * period] != first for g in range(1, groups)):
            continue
        runs = _runs(first)
        if len({label for label, _ in runs}) != len(runs):
            continue
        if groups > 1 and len(runs) == 1:
            continue  # one block repeated is the whole
        return [size for _, size in runs], groups
    return None
