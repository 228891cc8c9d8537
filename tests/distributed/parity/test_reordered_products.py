"""The reference's products are summed in float64 and rounded once, and no product slips by."""

from __future__ import annotations

import pytest
import torch
from reordered_products import ReorderedProducts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_products_round_once_from_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(3, 40, 40, generator=gen).to(dtype) for _ in range(3))
    with ReorderedProducts():
        product, scaled = a @ b, torch.baddbmm(c, a, b, beta=-4.5, alpha=2.0)
    assert torch.equal(product, (a.double() @ b.double()).to(dtype))
    assert torch.equal(scaled, (-4.5 * c.double() + 2.0 * (a.double() @ b.double())).to(dtype))


def test_a_product_it_does_not_resum_is_refused() -> None:
    a = torch.randn(4, 4)
    with ReorderedProducts(), pytest.raises(RuntimeError, match="does not re-sum einsum"):
        torch.einsum("ij,jk->ik", a, a)
