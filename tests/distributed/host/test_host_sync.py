"""A steady-state step never reads a device value on the host.

On CPU there is no device to wait for, so this counts the calls that would make the host
wait on a GPU (``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()`` and friends) made
by muon_dist's own code during a step after warm-up: there must be none. The GPU twin of
this test runs under ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/test_cuda_step.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dist

PACKAGE = os.path.dirname(muon_dist.__file__)
READS = ("item", "tolist", "__bool__", "cpu", "__float__", "__int__", "__index__", "numpy")


@contextmanager
def count_host_reads() -> Iterator[list[str]]:
    """Record every device-value read whose caller is a muon_dist module."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                calls.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _params(sharded: bool) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 12), (12, 40), (3, 10, 8), (24, 8)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    if sharded:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        muon = [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
    else:
        muon = [nn.Parameter(f) for f in fulls]
    return [
        {"params": muon[:2], "algorithm": "muon", "weight_decay": 0.1},
        {"params": muon[2:3], "algorithm": "muon", "experts": True, "magma": True},
        {"params": muon[3:], "algorithm": "muon", "split_sizes": [8, 16], "cautious_wd": True},
        {"params": [nn.Parameter(torch.randn(12, generator=gen))], "algorithm": "adamw"},
    ]


def _steady_state_reads(nonfinite: str, sharded: bool) -> list[str]:
    groups = _params(sharded)
    opt = muon_dist.Muon(groups, nonfinite=nonfinite)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    params = [p for g in groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)  # the same gradients on every rank (replicas)
    for p in params:
        grad = torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            grad = distribute_tensor(grad, p.device_mesh, p.placements)
        p.grad = grad
    for _ in range(2):
        opt.step()
        scheduler.step()
    with count_host_reads() as calls:
        opt.step()
        scheduler.step()
    return calls


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
def test_steady_state_step_reads_no_device_value(nonfinite: str) -> None:
    assert _steady_state_reads(nonfinite, sharded=False) == []


def distributed_worker(rank: int, world_size: int) -> list[list[str]]:
    """Both policies' reads on a sharded model (test_host_sync_slow.py)."""
    return [_steady_state_reads(policy, sharded=True) for policy in ("raise", "skip_step")]


def test_counter_sees_reads() -> None:
    """The counter is live: a read from code whose file lies in the package is caught."""
    probe = compile("bool(t) and t.tolist()", os.path.join(PACKAGE, "probe.py"), "exec")
    with count_host_reads() as calls:
        torch.ones(()).item()  # from this test: not counted
        exec(probe, {"t": torch.ones(())})
    assert len(calls) == 2 and all("probe.py" in c for c in calls)
