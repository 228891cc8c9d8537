"""Bit-for-bit comparison of tensors, for the tests that hold a fused form to its torch form."""

import torch

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(have: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """``have`` has ``want``'s dtype and bits: floats compare as their bit patterns, so -0.0
    is not 0.0 and NaNs must match too. ``what`` names the pair in a failure."""
    assert have.dtype == want.dtype, what
    if want.is_floating_point():
        integer = _SAME_SIZE_INT[want.element_size()]
        have, want = have.view(integer), want.view(integer)
    assert torch.equal(have, want), what
