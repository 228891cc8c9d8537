"""Where a pass takes its fused Triton form instead of its torch form: the one place that
chooses, for every batched op of the rules."""

from __future__ import annotations

import torch

from muon_dist.kernels.availability import triton_available

# Below this many elements a fused pass of one tensor loses to torch's kernels under
# ``backend="auto"``: its Triton launch covers one tensor, a torch foreach launch many, so on
# small tensors the host's launches cost more than the bytes cost the GPU. From about 1 M
# elements the fused pass is faster on the GPU and ties on the host (benchmarks/README.md,
# "Fused momentum and update passes"); inside a step the host runs ahead under
# Newton–Schulz, so the GPU's time is what counts there.
FUSED_MIN_NUMEL = 1 << 20


def fused_launches(backend: str, tensor: torch.Tensor) -> bool:
    """Whether a pass whose torch form is many small launches on small tensors takes its
    one-launch Triton form: wherever the backend allows Triton on CUDA, whatever the size,
    since what it saves is the host's time per launch."""
    return backend != "torch" and tensor.is_cuda and triton_available()


def fused_form(backend: str, *tensors: torch.Tensor) -> bool:
    """Whether the fused Triton form runs on these tensors, under the optimizer's backend.

    "torch" never fuses; "triton" fuses every contiguous CUDA tensor; "auto" only those of
    at least :data:`FUSED_MIN_NUMEL` elements, where the fused pass measured faster.
    """
    first = tensors[0]
    if backend == "torch" or not first.is_cuda:
        return False
    if backend == "auto" and first.numel() < FUSED_MIN_NUMEL:
        return False
    return _alike(*tensors) and triton_available()


def fused_pieces(backend: str, shard: torch.Tensor, momentum: torch.Tensor) -> bool:
    """Whether a tensor's shard pieces take the fused read and write passes: those launch
    from address tables, every piece of a batch in one launch, so like
    :func:`fused_launches` they pay wherever Triton runs, whatever the size; the shard and
    its momentum of one shape, each contiguous (a piece inside them may be strided)."""
    return fused_launches(backend, shard) and _alike(shard, momentum)


def _alike(*tensors: torch.Tensor) -> bool:
    """One shape, each contiguous: a fused pass reads every operand as consecutive elements
    from its address."""
    first = tensors[0]
    return all(t.shape == first.shape and t.is_contiguous() for t in tensors)
