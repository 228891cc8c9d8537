"""Trust across ranks, run on every rank of one spawned group: whatever differs between
ranks, or is refused on one of them, ends in an error on every rank (naming the key, the
ranks and their values) before anything changes, never in a hang or a silent divergence."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dist


def _rank() -> int:
    return dist.get_rank()


def _sharded(shape: tuple[int, ...], seed: int) -> nn.Parameter:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def _set_grads(params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        else:
            p.grad = grad


def _expect_everywhere(build: Callable[[], object], pattern: str) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        build()


def _refused_on_rank_1(build: Callable[[], object], own: type[Exception], pattern: str) -> None:
    """Rank 1 raises its own error; the others a RuntimeError quoting it."""
    if _rank() == 1:
        with pytest.raises(own, match=pattern):
            build()
    else:
        with pytest.raises(
            RuntimeError, match=r"(?s)refused on another rank .*rank 1: \w+: .*" + pattern
        ):
            build()


# -- construction ------------------------------------------------------------------------


def lr_differs_across_ranks() -> None:
    p = _sharded((8, 6), 0)
    lr = 0.02 if _rank() == 0 else 0.03
    _expect_everywhere(
        lambda: muon_dist.Muon([{"params": [p], "algorithm": "muon", "lr": lr}]),
        r"construction: the ranks disagree.*\n  param group 0 lr: ranks \[0\]: 0\.02; "
        r"ranks \[1\]: 0\.03",
    )


def nesterov_differs_across_ranks() -> None:
    p = _sharded((8, 6), 0)
    _expect_everywhere(
        lambda: muon_dist.Muon([p], nesterov=_rank() == 0),
        r"param group 0 nesterov: ranks \[0\]: True; ranks \[1\]: False",
    )


def setting_differs_across_ranks() -> None:
    p = _sharded((8, 6), 1)
    _expect_everywhere(
        lambda: muon_dist.Muon([p], bucket_bytes=2**20 * (1 + _rank())),
        r"setting bucket_bytes: ranks \[0\]: 1048576; ranks \[1\]: 2097152",
    )
    _expect_everywhere(
        lambda: muon_dist.Muon([p], nonfinite=("raise", "skip_step")[_rank()]),
        r"setting nonfinite: ranks \[0\]: 'raise'; ranks \[1\]: 'skip_step'",
    )


def setting_refused_on_one_rank() -> None:
    p = _sharded((8, 6), 2)
    _refused_on_rank_1(
        lambda: muon_dist.Muon([p], nonfinite="raise" if _rank() == 0 else "bogus"),
        ValueError,
        r"nonfinite='bogus'",
    )
    _refused_on_rank_1(
        lambda: muon_dist.Muon([p], max_inflight=3 if _rank() == 0 else 2.5),
        TypeError,
        r"max_inflight=2\.5 is a float",
    )


def named_params_in_another_order() -> None:
    params = [("a.weight", _sharded((8, 6), 3)), ("b.weight", _sharded((8, 6), 4))]
    listed = params if _rank() == 0 else params[::-1]
    _expect_everywhere(
        lambda: muon_dist.Muon(listed),
        r"parameter 0: ranks \[0\]: 'a\.weight' .*ranks \[1\]: 'b\.weight'",
    )


def unnamed_replicas_in_another_order() -> None:
    torch.manual_seed(5)
    a, b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6, 6))
    listed = [a, b] if _rank() == 0 else [b, a]
    _expect_everywhere(
        lambda: muon_dist.Muon(listed),
        r"parameter 0: ranks \[0\]: 'group0\.param0' \(6, 6\) torch\.float32 plain values ",
    )


# -- add_param_group and load_state_dict ------------------------------------------------


def add_param_group_is_agreed() -> None:
    p, q = _sharded((8, 6), 6), _sharded((6, 8), 7)
    opt = muon_dist.Muon([{"params": [p], "param_names": ["p"], "algorithm": "muon"}])
    steps = (5, 1)[_rank()]
    _expect_everywhere(
        lambda: opt.add_param_group({"params": [q], "param_names": ["q"], "ns_steps": steps}),
        r"add_param_group: the ranks disagree.*\n  param group 1 ns_steps: ranks \[0\]: 5; "
        r"ranks \[1\]: 1",
    )
    assert len(opt.param_groups) == 1
    bad = {"params": [q], "param_names": ["q"], "lr": 0.02 if _rank() == 0 else float("nan")}
    _refused_on_rank_1(lambda: opt.add_param_group(bad), ValueError, r"lr=nan is not finite")
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "param_names": ["q"], "split_sizes": [2, 4]})
    _set_grads([p, q], 8)
    opt.step()


def load_state_dict_is_agreed() -> None:
    p = _sharded((8, 6), 9)
    opt = muon_dist.Muon([{"params": [p], "param_names": ["p"], "algorithm": "muon"}])
    _set_grads([p], 10)
    opt.step()
    saved = opt.state_dict()
    before = opt.state[p]["momentum_buffer"].full_tensor()
    other = {**saved, "param_groups": [{**saved["param_groups"][0], "lr": 0.1 * (1 + _rank())}]}
    _expect_everywhere(
        lambda: opt.load_state_dict(other),
        r"(?s)load_state_dict: the ranks disagree.*"
        r"param group 0 lr: ranks \[0\]: 0\.1; ranks \[1\]: 0\.2",
    )
    broken = {**saved, "state": {0: {"momentum_buffer": saved["state"][0]["momentum_buffer"]}}}
    if _rank() == 1:
        local = broken["state"][0]["momentum_buffer"].to_local().clone()
        local[0, 0] = float("inf")
        momentum = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
        broken = {**saved, "state": {0: {"momentum_buffer": momentum}}}
    _refused_on_rank_1(
        lambda: opt.load_state_dict(broken),
        ValueError,
        r"p: saved momentum_buffer holds non-finite",
    )
    assert torch.equal(opt.state[p]["momentum_buffer"].full_tensor(), before)
    assert opt.param_groups[0]["lr"] == 0.02


# -- saving (item 10) -------------------------------------------------------------------


def _fsdp_model(world_size: int) -> nn.Module:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def _train(model: nn.Module, opt: muon_dist.Muon, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def fsdp_state_dict_round_trips_through_torch_save() -> None:
    world_size = dist.get_world_size()
    model = _fsdp_model(world_size)
    opt = muon_dist.Muon(muon_dist.param_groups(model), comm_dtype=torch.float32)
    _train(model, opt, 0)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # fails on b89905a: momenta are views at an offset
    twin = _fsdp_model(world_size)
    twin.load_state_dict(model.state_dict())
    twin_opt = muon_dist.Muon(muon_dist.param_groups(twin), comm_dtype=torch.float32)
    buffer.seek(0)
    twin_opt.load_state_dict(torch.load(buffer, weights_only=False))
    for m, o in ((model, opt), (twin, twin_opt)):
        _train(m, o, 1)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(_full(a), _full(b))


def _bf16_step(module: nn.Module, opt: muon_dist.Muon) -> list[torch.Tensor]:
    _set_grads(list(module.parameters()), 23)
    opt.step()
    return [_full(p).clone() for p in module.parameters()]


def sharded_module_cast_after_construction_keeps_training() -> None:
    """``module.to(torch.bfloat16)`` on sharded (DTensor) parameters after construction: the
    step follows the new storage and dtype, as a fresh optimizer loaded with the state."""
    module = nn.Module()
    module.w, module.v = _sharded((8, 6), 20), _sharded((6, 4), 21)
    opt = muon_dist.Muon(list(module.named_parameters()), comm_dtype=torch.float32)
    _set_grads(list(module.parameters()), 22)
    opt.step()
    module.to(torch.bfloat16)
    before = [_full(p).clone() for p in module.parameters()]
    twin = nn.Module()
    twin.w, twin.v = (
        nn.Parameter(distribute_tensor(full, p.device_mesh, p.placements))
        for full, p in zip(before, module.parameters(), strict=True)
    )
    twin_opt = muon_dist.Muon(list(twin.named_parameters()), comm_dtype=torch.float32)
    twin_opt.load_state_dict(opt.state_dict())
    after, expected = _bf16_step(module, opt), _bf16_step(twin, twin_opt)
    for a, b, old in zip(after, expected, before, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
        assert not torch.equal(a, old), "the step left a matrix where it was"


# -- steps ------------------------------------------------------------------------------


def closure_raising_on_one_rank_is_agreed() -> None:
    p = _sharded((8, 6), 12)
    opt = muon_dist.Muon([{"params": [p], "param_names": ["p"], "algorithm": "muon"}])
    _set_grads([p], 13)
    before = _full(p).clone()

    def closure() -> float:
        if _rank() == 1:
            raise KeyError("data loader ran dry")
        return 1.0

    if _rank() == 1:
        with pytest.raises(KeyError, match="data loader ran dry"):
            opt.step(closure)
    else:
        with pytest.raises(RuntimeError, match=r"step 1 failed on rank 1, .*closure raised"):
            opt.step(closure)
    assert torch.equal(_full(p), before)
    assert opt.param_groups[0]["steps"] == 0
    opt.step()
    assert not torch.equal(_full(p), before)


def _changed_on_rank_1(
    key: str, value: object, pattern: str, sharded: bool, **options: Any
) -> None:
    """``key`` set to ``value`` on rank 1 between steps: the next step fails on every rank
    naming it, changes nothing and is not counted; set back, the step runs."""
    torch.manual_seed(14)  # a replica starts equal on every rank
    p = _sharded((8, 6), 14) if sharded else nn.Parameter(torch.randn(8, 6))
    bias = nn.Parameter(torch.zeros(6))
    opt = muon_dist.Muon(
        [{"params": [p], "param_names": ["w"]}, {"params": [bias], "param_names": ["b"]}],
        **options,
    )
    _set_grads([p, bias], 15)
    opt.step()
    group = opt.param_groups[0 if key != "betas" else 1]
    original = group[key]
    if _rank() == 1:
        group[key] = value
    before = (_full(p).clone(), bias.detach().clone())
    with pytest.raises(RuntimeError, match=r"step 2: the ranks disagree: " + pattern):
        opt.step()
    assert torch.equal(_full(p), before[0]) and torch.equal(bias.detach(), before[1])
    assert [g["steps"] for g in opt.param_groups] == [1, 1]
    group[key] = original
    opt.step()
    assert not torch.equal(_full(p), before[0])


def scheduler_values_are_agreed_every_step() -> None:
    ranks = r".*ranks by their options: \[0\] \| \[1\]"
    _changed_on_rank_1("lr", 0.01, r"param group 0 lr ranges from 0\.01.* to 0\.02" + ranks, True)
    _changed_on_rank_1("momentum", 0.9, r"param group 0 momentum ranges from 0\.9", False)
    _changed_on_rank_1("nesterov", False, r"param group 0 nesterov ranges from 0 to 1", True)
    _changed_on_rank_1("betas", (0.8, 0.95), r"param group 1 betas\[0\] ranges", False)
    # Read when the step is built: rank 1 rebuilds, learns the others did not, and joins
    # their step's collectives; each rank shows its own value.
    _changed_on_rank_1(
        "ns_steps", 3, r"param group 0 ns_steps differs \([35] on this rank\)" + ranks, True
    )
    dion2 = r"param group 0 dion2_fraction differs \(0\.[25]5? on this rank\)" + ranks
    _changed_on_rank_1("dion2_fraction", 0.5, dion2, True, rule="dion2")


def replicas_with_different_gradients_fail_the_step() -> None:
    torch.manual_seed(16)
    w, v = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6, 4))
    opt = muon_dist.Muon([("w", w), ("v", v)])
    before = (w.detach().clone(), v.detach().clone())
    w.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(_rank()))
    v.grad = torch.ones(6, 4)
    with pytest.raises(RuntimeError, match=r"the gradient of w, held whole on every rank"):
        opt.step()
    assert torch.equal(w.detach(), before[0]) and torch.equal(v.detach(), before[1])
    w.grad = torch.ones(8, 6)  # averaged: equal everywhere
    opt.step()
    gathered: list[torch.Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, w.detach())
    assert all(torch.equal(g, w.detach()) for g in gathered if g is not None)
    assert not torch.equal(w.detach(), before[0])


CASES: dict[str, Callable[[], None]] = {
    case.__name__: case
    for case in (
        lr_differs_across_ranks,
        nesterov_differs_across_ranks,
        setting_differs_across_ranks,
        setting_refused_on_one_rank,
        named_params_in_another_order,
        unnamed_replicas_in_another_order,
        add_param_group_is_agreed,
        load_state_dict_is_agreed,
        fsdp_state_dict_round_trips_through_torch_save,
        sharded_module_cast_after_construction_keeps_training,
        closure_raising_on_one_rank_is_agreed,
        scheduler_values_are_agreed_every_step,
        replicas_with_different_gradients_fail_the_step,
    )
}


def trust_worker(rank: int, world_size: int, name: str) -> str:
    logging.getLogger("muon_dist").setLevel(logging.ERROR)
    CASES[name]()
    return name


def save_worker(rank: int, world_size: int) -> Any:
    fsdp_state_dict_round_trips_through_torch_save()
    return "saved"
