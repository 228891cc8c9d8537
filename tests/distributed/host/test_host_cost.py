"""A steady-state step's host work does not grow with the number of like matrices.

Every call into the dispatcher costs the host time, views included: a step that took one
view per piece of each fresh buffer spent most of its host time on them with many small
matrices. Counting every operation (views too) for few and for many same-shape matrices
checks that the pieces' views are taken per run of like pieces, laid out once per plan.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dispatch_count import CountOps
from dist_harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import muon_dist


def _steady_state_ops(layers: int, nonfinite: str, sharded: bool) -> Counter[str]:
    """Operations of one step after warm-up on ``layers`` pairs of interleaved shapes."""
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=gen) for _ in range(layers) for shape in ((8, 6), (6, 8))]
    if sharded:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        params = [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
    else:
        params = [nn.Parameter(f) for f in fulls]
    opt = muon_dist.Muon(
        [{"params": params, "algorithm": "muon"}],
        weight_decay=0.1,
        nonfinite=nonfinite,
        bucket_bytes=1 << 30,
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    counter = CountOps()
    with counter:
        opt.step()
    return counter.ops


def _growth(nonfinite: str, sharded: bool) -> Counter[str]:
    few = _steady_state_ops(4, nonfinite, sharded)
    many = _steady_state_ops(16, nonfinite, sharded)
    return (many - few) + (few - many)


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_operations_per_step_do_not_grow_with_the_matrix_count(nonfinite: str) -> None:
    assert _growth(nonfinite, sharded=False) == Counter()


def _sharded_worker(rank: int, world_size: int) -> list[Counter[str]]:
    return [_growth(policy, sharded=True) for policy in ("raise", "skip_step")]


def test_sharded_operations_per_step_do_not_grow_with_the_matrix_count() -> None:
    """Gathered, orthogonalized and scattered pieces too: views of the stacks and exchange
    buffers are taken per run of like pieces, not per piece."""
    for growth in run_distributed(2, _sharded_worker, timeout=180):
        assert growth == [Counter(), Counter()]
