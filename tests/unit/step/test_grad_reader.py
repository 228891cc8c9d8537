"""The step's reads of the local gradients (:class:`muon_dist.step.agree.grad_check.GradReader`):
a read reports whether any gradient is another tensor than at the last read, which a captured
step trusts to reuse the gradients' addresses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muon_dist.step.agree.grad_check import GradReader


def _reader() -> tuple[list[nn.Parameter], GradReader]:
    params = [nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(4))]
    return params, GradReader(["a", "b"], params)


def test_a_read_of_the_same_tensors_is_not_fresh() -> None:
    params, reader = _reader()
    params[0].grad = torch.zeros(2, 3)
    grads, present, fresh = reader.read()
    assert fresh and present == [True, False] and grads[0] is params[0].grad
    grads, present, fresh = reader.read()
    assert not fresh and present == [True, False] and grads[0] is params[0].grad


@pytest.mark.parametrize("change", ["replaced", "freed", "added"])
def test_any_other_tensor_makes_a_read_fresh(change: str) -> None:
    params, reader = _reader()
    params[0].grad = torch.zeros(2, 3)
    reader.read()
    if change == "replaced":
        params[0].grad = torch.ones(2, 3)
    elif change == "freed":
        params[0].grad = None
    else:
        params[1].grad = torch.zeros(4)
    grads, present, fresh = reader.read()
    assert fresh
    assert present == [g is not None for g in (params[0].grad, params[1].grad)]
    assert all(g is p.grad for g, p in zip(grads, params, strict=True))


def test_a_gradient_read_by_a_hook_makes_the_next_read_fresh() -> None:
    params, reader = _reader()
    params[0].grad = torch.zeros(2, 3)
    reader.read()
    params[1].grad = torch.zeros(4)
    assert reader.one(1) is params[1].grad
    _, present, fresh = reader.read()
    assert fresh and present == [True, True]


def test_a_refused_gradient_is_checked_again_at_the_next_read() -> None:
    params, reader = _reader()
    params[0].grad = torch.zeros(2, 3)
    reader.read()
    params[1].grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match="b has a sparse gradient"):
        reader.read()
    with pytest.raises(TypeError, match="b has a sparse gradient"):
        reader.read()
    params[1].grad = torch.zeros(4)
    _, present, fresh = reader.read()
    assert fresh and present == [True, True]
