"""Parameter layouts for the planner's tests without processes (tests/unit/comm/test_plan.py,
tests/unit/plan/test_in_place.py): one :class:`ViewPlacement` by hand, and random ones for
hypothesis."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from muon_dist.plan.build import ViewPlacement
from muon_dist.plan.views import matrix_view


def placement(
    name: str,
    shape: tuple[int, ...],
    mesh: tuple[int, ...],
    dims: tuple[int | None, ...],
    **view: object,
) -> ViewPlacement:
    """``shape`` as a matrix view (``view``: its options, as :func:`matrix_view`'s) on
    ``mesh`` over ranks 0..N-1, tensor dim ``dims[i]`` split over mesh dim ``i`` (None:
    replicated), quintic Newton-Schulz of 5 steps."""
    return ViewPlacement(
        name,
        matrix_view(shape, name=name, **view),
        mesh,
        tuple(range(math.prod(mesh))),
        dims,
        (5, "quintic"),  # type: ignore[arg-type]
    )


@st.composite
def random_placements(
    draw: st.DrawFn, *, max_views: int, max_stack: int, max_fused: int
) -> tuple[list[ViewPlacement], int]:
    """1 to ``max_views`` views of up to 9x9 on one random mesh, and its number of ranks: plain
    matrices, expert stacks of 1 to ``max_stack`` matrices, and 1 to ``max_fused`` experts
    fused along the rows, each tensor dim split over any mesh dim or none."""
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (1, 3), (3, 1)]))
    layouts = []
    for i in range(draw(st.integers(1, max_views))):
        kind = draw(st.sampled_from(["matrix", "experts", "fused"]))
        rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        view: dict[str, object] = {}
        if kind == "experts":
            shape: tuple[int, ...] = (draw(st.integers(1, max_stack)), rows, cols)
            view["experts"] = True
        elif kind == "fused":
            experts = draw(st.integers(1, max_fused))
            shape = (experts * rows, cols)
            view["num_experts"] = experts
        else:
            shape = (rows, cols)
        dims = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh)
        layouts.append(placement(f"p{i}", shape, mesh, dims, **view))
    return layouts, math.prod(mesh)
