"""Dion2's rectangle moves in one launch (``muon_dist.kernels.triton_rects``) on CPU through
Triton's interpreter, against torch's indexing (``selection.take_into``, ``put_``); fp32,
the interpreter's exact dtype."""

import pytest
import torch

from muon_dist.kernels.availability import interpret_mode
from muon_dist.selection import Rect, put_, take_into

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_rects = pytest.importorskip("muon_dist.kernels.triton_rects")


def _rects(generator: torch.Generator) -> list[tuple[torch.Tensor, Rect]]:
    """Every form a rectangle takes: selected rows, selected columns, several groups of
    both, a whole plane, an empty one; planes of different widths, one a strided view."""
    plane = torch.randn(40, 30, generator=generator)
    wide = torch.randn(50, 70, generator=generator)[:, :64]  # row stride 70
    rows = torch.randperm(40, generator=generator)[:7].sort().values
    cols = torch.randperm(64, generator=generator)[:9].sort().values
    groups_rows = torch.stack([torch.randperm(40, generator=generator)[:5] for _ in range(3)])
    groups_cols = torch.stack([torch.randperm(30, generator=generator)[:4] for _ in range(3)])
    return [
        (plane, Rect((1, 7, 30), rows[None], None)),
        (wide, Rect((1, 50, 9), None, cols[None])),
        (plane, Rect((3, 5, 4), groups_rows, groups_cols)),
        (wide, Rect((1, 50, 64), None, None)),
        (plane, Rect((1, 0, 30), rows[None, :0], None)),
    ]


def test_gathers_in_one_launch_match_torch_indexing() -> None:
    generator = torch.Generator().manual_seed(0)
    rects = _rects(generator)
    total = sum(r.numel for _, r in rects)
    expected, got = torch.empty(total), torch.full((total,), float("nan"))
    offset, moves = 0, []
    for x, r in rects:
        take_into(expected[offset : offset + r.numel], x, r)
        flat = got[offset : offset + r.numel]
        moves.append(triton_rects.RectMove(flat, x, r.rows, r.cols, r.shape))
        offset += r.numel
    triton_rects.move_rects_triton(moves, gather=True)
    assert torch.equal(got, expected)


def test_puts_in_one_launch_match_torch_indexing() -> None:
    generator = torch.Generator().manual_seed(1)
    rects = _rects(generator)
    values = torch.randn(sum(r.numel for _, r in rects), generator=generator)
    targets = [(x.clone(), x.clone()) for x, _ in rects]
    offset, moves = 0, []
    for (want, got), (_, r) in zip(targets, rects, strict=True):
        put_(want, r, values[offset : offset + r.numel])
        moves.append(
            triton_rects.RectMove(values[offset : offset + r.numel], got, r.rows, r.cols, r.shape)
        )
        offset += r.numel
    triton_rects.move_rects_triton(moves, gather=False)
    for want, got in targets:
        assert torch.equal(got, want)
