"""The fused momentum and update passes on CPU through Triton's interpreter, against torch.

conftest.py turns the interpreter on (TRITON_INTERPRET=1) before Triton is imported, on
machines without CUDA. The state is fp32 here: the interpreter's rounding of intermediates
to bf16 differs from the GPU's, so bf16 state is checked on a GPU (tests/test_gpu_kernels.py).
"""

import pytest
import torch

from muon_dist.kernels.elementwise import advance_momentum, decay_and_update_, momentum_input_
from muon_dist.kernels.triton_ns import interpret_mode

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_elementwise = pytest.importorskip("muon_dist.kernels.triton_elementwise")

# Sizes around the kernel's 4096-element blocks, and a 3-D shape like an expert stack piece.
SHAPES = [(1,), (4095,), (4097,), (3, 50, 70)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mix", [0.95, None])
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_momentum_input_matches_torch(
    shape: tuple[int, ...], mix: float | None, store: bool, out_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    grad = torch.randn(shape)
    momentum = torch.randn(shape)
    expected_momentum = momentum.clone()
    expected = torch.empty(shape, dtype=out_dtype)
    momentum_input_(grad, expected_momentum, expected, 0.9, mix, store)  # torch on CPU
    out = torch.full(shape, float("nan"), dtype=out_dtype)
    before = momentum.clone()
    triton_elementwise.momentum_input_triton(grad, momentum, out, 0.9, mix, store)
    torch.testing.assert_close(out, expected)
    if store:
        torch.testing.assert_close(momentum, advance_momentum(grad, before, 0.9))
    else:
        assert torch.equal(momentum, before), "store=False must leave the momentum alone"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("decay", [1.0, 0.998])
def test_decay_and_update_matches_torch(shape: tuple[int, ...], decay: float) -> None:
    torch.manual_seed(1)
    param = torch.randn(shape)
    update = torch.randn(shape).bfloat16()
    expected = param.clone()
    decay_and_update_(expected, update, decay, -0.02)  # torch on CPU
    triton_elementwise.decay_and_update_triton(param, update, decay, -0.02)
    torch.testing.assert_close(param, expected)


def test_cpu_dispatch_uses_torch_arithmetic() -> None:
    """On CPU the dispatcher runs the same two torch adds the optimizer always ran."""
    torch.manual_seed(2)
    grad, momentum = torch.randn(2, 300, 300), torch.randn(2, 300, 300)
    out = torch.empty(2, 300, 300, dtype=torch.bfloat16)
    advanced = torch.add(grad, momentum, alpha=0.9)
    expected = torch.add(grad, advanced, alpha=0.95).bfloat16()
    momentum_input_(grad, momentum, out, 0.9, 0.95)
    assert torch.equal(momentum, advanced) and torch.equal(out, expected)
