"""The fused momentum and update passes keep parity on every layout, strided pieces included.

On CUDA the step takes the fused Triton passes for every piece (``backend`` "auto" or
"triton"); the CPU suite takes torch's forms. Here the fused passes are forced onto every
piece and run through Triton's interpreter, on the layouts whose pieces are strided: column
shards (``shard1``) and their regions in a stack, tensor-parallel blocks (``tp_fsdp``),
expert stacks beside FSDP (``ep_fsdp``). fp32 only: the interpreter rounds fp32 to bf16
toward zero, where a GPU rounds to nearest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import run_distributed
from parity_cases import parity_violations, parity_worker

from muon_dist.kernels.availability import interpret_mode, triton_available

if not interpret_mode():
    pytest.skip("forcing the fused passes on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def _fused_everywhere(backend: str, shard: torch.Tensor, momentum: torch.Tensor) -> bool:
    """:func:`muon_dist.rules.forms.fused_pieces` without its CUDA condition."""
    alike = shard.shape == momentum.shape and shard.is_contiguous() and momentum.is_contiguous()
    return backend != "torch" and alike and triton_available()


def fused_parity_worker(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """The fp32 parity case ``name`` with the fused passes on every piece; the session's
    worker processes get the usual forms back afterwards."""
    from muon_dist.step.program import binding

    usual = binding.fused_pieces
    binding.fused_pieces = _fused_everywhere
    try:
        return parity_worker(rank, world_size, name, "float32", "float32")
    finally:
        binding.fused_pieces = usual


@pytest.mark.parametrize(("world_size", "name"), [(2, "shard1"), (4, "tp_fsdp"), (4, "ep_fsdp")])
def test_fused_passes_keep_parity_on_strided_layouts(world_size: int, name: str) -> None:
    results = run_distributed(world_size, fused_parity_worker, name)
    for rank, err in enumerate(results):
        assert not parity_violations(err, "fp32"), f"rank {rank}: {err}"
