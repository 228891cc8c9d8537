"""Matrix products as another machine's kernel would compute them, for the reference step.

CPU and GPU matmul kernels sum in different orders (blocking, batching, Intel AMX tiles), so
the same bf16 product can round to a different bf16 value on another machine, or in another
batch shape on the same one. A reference that ran on this machine's own kernels would agree
with the optimizer to the last bit here and could still disagree elsewhere; under
:class:`ReorderedProducts` the reference's products are summed in float64 and rounded once
to their dtype, an order no production kernel uses, so every run of the suite sees the
rounding differences a kernel change brings, on any CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PRODUCTS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
    }
)
_SCALED_SUMS: frozenset[Callable[..., Any]] = frozenset(
    {torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm}
)
# Products this mode does not re-sum: one of them in the reference would run on this
# machine's kernel and hide the difference the mode exists to show.
_REFUSED: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.__rmatmul__,
        torch.Tensor.baddbmm_,
        torch.Tensor.addmm_,
        torch.addbmm,
        torch.einsum,
        torch.tensordot,
        torch.linalg.matmul,
        torch.linalg.multi_dot,
    }
)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.double(), b.double())


class ReorderedProducts(TorchFunctionMode):
    """Inside it, floating-point matrix products are summed in float64, rounded once."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _REFUSED:
            raise RuntimeError(
                f"ReorderedProducts does not re-sum {func.__name__}: the reference would use "
                "this machine's kernel for it; add it to tests/support/reordered_products.py"
            )
        floating = all(t.is_floating_point() for t in args if isinstance(t, torch.Tensor))
        if floating and (func in _PRODUCTS or func in _SCALED_SUMS):
            if "out" in kwargs:
                raise RuntimeError(f"ReorderedProducts: {func.__name__}(out=...) is not re-summed")
            if func in _PRODUCTS:
                a, b = args
                return _product(a, b).to(torch.promote_types(a.dtype, b.dtype))
            base, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            return (beta * base.double() + alpha * _product(a, b)).to(base.dtype)
        return func(*args, **kwargs)
