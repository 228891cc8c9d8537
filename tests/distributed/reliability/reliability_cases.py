"""Distributed failure modes, run on every rank of one spawned group."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parity_cases import PRECISIONS, Case, P, run_case
from reference_muon import reference_muon_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import muon_dist


def _sharded(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, nn.Parameter]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return full, nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))


def nonfinite_on_one_rank_skips_everywhere(rule: str = "muon") -> None:
    full, p = _sharded((10, 6), 0)
    bias = nn.Parameter(torch.zeros(6))
    opt = muon_dist.Muon(
        [{"params": [p], "algorithm": "muon"}, {"params": [bias], "algorithm": "adamw"}],
        nonfinite="skip_step",
        rule=rule,
    )
    grad = torch.randn(10, 6)
    if dist.get_rank() == 1:
        grad[-1, 0] = float("nan")  # lands in rank 1's shard only
    # src_data_rank=None: every rank keeps its own chunk, so the NaN stays on rank 1.
    p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)], src_data_rank=None)
    bias.grad = torch.ones(6)
    opt.step()
    assert torch.equal(p.full_tensor(), full), "a skipped step changed the parameter"
    assert torch.equal(bias.detach(), torch.zeros(6))
    assert opt.param_groups[0]["skipped_steps"] == 1
    assert torch.count_nonzero(opt.state[p]["momentum_buffer"].full_tensor()) == 0
    muon = opt.runner.muon
    assert muon is not None and any(w.packed for w in muon.wings.values()) == (rule == "dion2")

    raising = muon_dist.Muon(
        [{"params": [p], "param_names": ["mlp.w"], "algorithm": "muon"}], rule=rule
    )
    with pytest.raises(FloatingPointError, match=r"step 1: non-finite gradient in mlp\.w"):
        raising.step()


def dion2_nonfinite_on_one_rank_skips_everywhere() -> None:
    """Under Dion2 the NaN also reaches every rank's slice norms (one all-reduce)."""
    nonfinite_on_one_rank_skips_everywhere("dion2")


def gradient_on_some_ranks_only_counts_as_zero() -> None:
    full, p = _sharded((9, 5), 1)
    opt = muon_dist.Muon(
        [{"params": [p], "algorithm": "muon"}], comm_dtype=torch.float32, ns_dtype=torch.float32
    )
    grad = torch.randn(9, 5, generator=torch.Generator().manual_seed(2))
    p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)], src_data_rank=None)
    rows = grad.chunk(2)[0].shape[0]  # rank 0's shard
    if dist.get_rank() == 1:
        p.grad = None
    opt.step()  # rank 1 has no gradient: a zero gradient there, and no hang
    expected_grad = grad.clone()
    expected_grad[rows:] = 0
    ref = full.clone()
    reference_muon_step(ref, expected_grad, torch.zeros_like(ref), lr=0.02, ns_dtype=torch.float32)
    torch.testing.assert_close(p.full_tensor(), ref, rtol=0, atol=1e-6)


def no_gradient_anywhere_is_left_alone() -> None:
    full, p = _sharded((8, 4), 3)
    opt = muon_dist.Muon([{"params": [p], "algorithm": "muon", "weight_decay": 0.1}])
    opt.step()
    assert torch.equal(p.full_tensor(), full)


def nonfinite_result_on_one_rank_skips_everywhere() -> None:
    import muon_dist.step.bucket.orthogonalizer as optimizer_module

    fulls_params = [_sharded((10, 6), 4), _sharded((6, 10), 5)]
    params = [p for _, p in fulls_params]
    opt = muon_dist.Muon([{"params": params, "algorithm": "muon"}], nonfinite="skip_step")
    for full, p in fulls_params:
        p.grad = distribute_tensor(torch.randn(full.shape), p.device_mesh, [Shard(0)])
    original = optimizer_module.newton_schulz

    def broken_on_rank_1(stack: torch.Tensor, **kwargs: object) -> torch.Tensor:
        result = original(stack, **kwargs)  # type: ignore[arg-type]
        return result * float("nan") if dist.get_rank() == 1 else result

    optimizer_module.newton_schulz = broken_on_rank_1  # type: ignore[assignment]
    try:
        opt.step()
    finally:
        optimizer_module.newton_schulz = original
    for full, p in fulls_params:
        assert torch.equal(p.full_tensor(), full), "a skipped step changed a parameter"
    assert opt.param_groups[0]["skipped_steps"] == 1


def _steps_everywhere(opt: muon_dist.Muon) -> list[int]:
    """Every rank's step counters, gathered."""
    mine = [g["steps"] for g in opt.param_groups] + [g["skipped_steps"] for g in opt.param_groups]
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    assert all(g == mine for g in gathered), f"step counters differ across ranks: {gathered}"
    return mine


def overflow_in_newton_schulz_raises_on_every_rank() -> None:
    """A finite gradient whose norm would overflow Newton–Schulz: refused everywhere."""
    full, p = _sharded((10, 6), 6)
    bias_full, bias = _sharded((6,), 7)
    opt = muon_dist.Muon(
        [
            {"params": [p], "param_names": ["mlp.w"], "algorithm": "muon"},
            {"params": [bias], "param_names": ["norm.b"], "algorithm": "adamw"},
        ]
    )
    grad = torch.randn(10, 6)
    if dist.get_rank() == 1:
        grad[-1, 0] = 1.5e19  # rank 1's shard only
    p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)], src_data_rank=None)
    bias.grad = distribute_tensor(torch.ones(6), bias.device_mesh, [Shard(0)])
    with pytest.raises(FloatingPointError, match=r"step 1: gradient norm too large in mlp\.w"):
        opt.step()
    assert torch.equal(p.full_tensor(), full) and torch.equal(bias.full_tensor(), bias_full)
    assert torch.count_nonzero(opt.state[p]["momentum_buffer"].full_tensor()) == 0
    assert float(opt.state[bias]["step"]) == 0.0
    _steps_everywhere(opt)


def gradient_placements_are_checked_on_every_rank() -> None:
    """A gradient laid out unlike its parameter is refused; the others learn of it."""
    full, p = _sharded((8, 6), 8)
    opt = muon_dist.Muon([{"params": [p], "param_names": ["attn.wo"], "algorithm": "muon"}])
    grad = torch.randn(8, 6)
    # Replicate() on every rank: refused on every rank, naming both placements.
    p.grad = distribute_tensor(grad, p.device_mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"attn\.wo: gradient placements \(Replicate\(\),\)"):
        opt.step()
    # Shard(1) on rank 0 only: rank 0 names it, rank 1 learns that rank 0 failed; no hang.
    if dist.get_rank() == 0:
        p.grad = DTensor.from_local(grad[:, :3], p.device_mesh, [Shard(1)], run_check=False)
        error, pattern = ValueError, r"attn\.wo: gradient placements \(Shard\(dim=1\),\)"
    else:
        p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)], src_data_rank=None)
        error, pattern = RuntimeError, r"step 1 failed on rank 0, which refused its inputs"
    with pytest.raises(error, match=pattern):
        opt.step()
    assert torch.equal(p.full_tensor(), full)
    assert torch.count_nonzero(opt.state[p]["momentum_buffer"].full_tensor()) == 0
    _steps_everywhere(opt)
    # Fixed inputs: the next step runs on every rank.
    p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)])
    opt.step()
    assert not torch.equal(p.full_tensor(), full)


def adamw_gradient_on_some_ranks_only_counts_as_zero() -> None:
    """As for Muon: a shard without a gradient takes a zero one when another rank has one."""
    full, bias = _sharded((6,), 9)
    opt = muon_dist.Muon([{"params": [bias], "algorithm": "adamw", "lr": 0.1}])
    grad = torch.randn(6, generator=torch.Generator().manual_seed(10))
    bias.grad = distribute_tensor(grad, bias.device_mesh, [Shard(0)], src_data_rank=None)
    rows = grad.chunk(2)[0].shape[0]
    if dist.get_rank() == 1:
        bias.grad = None
    opt.step()
    expected_grad = grad.clone()
    expected_grad[rows:] = 0
    ref = nn.Parameter(full.clone())
    ref.grad = expected_grad
    reference = torch.optim.AdamW([ref], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    reference.step()
    torch.testing.assert_close(bias.full_tensor(), ref.detach(), rtol=0, atol=1e-6)
    steps: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, float(opt.state[bias]["step"]))
    assert steps == [1.0] * dist.get_world_size(), steps


def _exception_on_one_rank_is_agreed(
    site: str, policies: tuple[str, ...], rule: str = "muon"
) -> None:
    """``site`` raises on rank 1 only: it raises that, the others name it; no hang."""
    import muon_dist.step.bucket.orthogonalizer as step_module
    import muon_dist.step.shard.piece_io as io_module

    owner: object = step_module if site == "newton_schulz" else io_module.PieceIO
    pairs = [_sharded((10, 6), 11), _sharded((6, 10), 12)]
    params = [p for _, p in pairs]
    original = getattr(owner, site)

    def broken_on_rank_1(*args: object, **kwargs: object) -> object:
        if dist.get_rank() == 1:
            raise RuntimeError("kernel exploded")
        return original(*args, **kwargs)

    for policy in policies:
        opt = muon_dist.Muon([{"params": params, "algorithm": "muon"}], nonfinite=policy, rule=rule)
        for full, p in pairs:
            p.grad = distribute_tensor(torch.randn(full.shape), p.device_mesh, [Shard(0)])
        setattr(owner, site, broken_on_rank_1)
        try:
            if dist.get_rank() == 1:
                error, pattern = RuntimeError, r"kernel exploded"
            else:
                error, pattern = (
                    RuntimeError,
                    r"step 1 failed on rank 1: its Newton–Schulz or the read or write of an "
                    "update raised",
                )
            with pytest.raises(error, match=pattern):
                opt.step()
        finally:
            setattr(owner, site, original)
        if policy == "skip_step":
            for full, p in pairs:
                assert torch.equal(p.full_tensor(), full), "a failed step changed a parameter"
        _steps_everywhere(opt)
        opt.step()  # the next step runs on every rank


def exception_in_newton_schulz_on_one_rank_is_agreed() -> None:
    _exception_on_one_rank_is_agreed("newton_schulz", ("skip_step", "raise"))


def exception_reading_an_update_on_one_rank_is_agreed() -> None:
    _exception_on_one_rank_is_agreed("read", ("skip_step", "raise"))


def dion2_exception_on_one_rank_is_agreed() -> None:
    """Dion2's bucket (norms, choice, selected slices) agrees on a failed read or
    Newton–Schulz like the plain one: no rank is left in a collective."""
    _exception_on_one_rank_is_agreed("read", ("skip_step", "raise"), "dion2")
    _exception_on_one_rank_is_agreed("newton_schulz", ("skip_step", "raise"), "dion2")


def exception_writing_an_update_on_one_rank_is_agreed() -> None:
    # Only under "raise": a transactional step writes after the ranks' last agreement.
    _exception_on_one_rank_is_agreed("write", ("raise",))


def full_momentum_for_a_sharded_parameter_is_refused() -> None:
    """A state holding whole momenta (a gathered checkpoint) for sharded parameters: refused
    by name before anything changes, pointing at torch.distributed.checkpoint."""
    full, p = _sharded((8, 6), 14)
    opt = muon_dist.Muon([{"params": [p], "algorithm": "muon"}])
    p.grad = distribute_tensor(torch.randn(full.shape), p.device_mesh, [Shard(0)])
    opt.step()
    state = opt.state_dict()
    state["state"][0] = {**state["state"][0], "momentum_buffer": torch.ones(full.shape)}
    before = opt.state[p]["momentum_buffer"].full_tensor()
    with pytest.raises(ValueError, match=r"group0\.param0: the saved momentum holds a local shard"):
        opt.load_state_dict(state)
    assert torch.equal(opt.state[p]["momentum_buffer"].full_tensor(), before)


def option_refused_on_one_rank_raises_on_every_rank() -> None:
    """An lr that is NaN on rank 1 only: rank 1 names it, rank 0 learns it at construction."""
    _, p = _sharded((8, 6), 13)
    lr = float("nan") if dist.get_rank() == 1 else 0.02
    if dist.get_rank() == 1:
        error, pattern = ValueError, r"param group 0 \(muon\): lr=nan is not finite"
    else:
        error, pattern = (
            RuntimeError,
            r"refused on another rank .* rank 1: ValueError: param group 0 \(muon\): lr=nan",
        )
    with pytest.raises(error, match=pattern):
        muon_dist.Muon([{"params": [p], "algorithm": "muon", "lr": lr}])


CHECKS: dict[str, Callable[[], None]] = {
    check.__name__: check
    for check in (
        nonfinite_on_one_rank_skips_everywhere,
        dion2_nonfinite_on_one_rank_skips_everywhere,
        gradient_on_some_ranks_only_counts_as_zero,
        no_gradient_anywhere_is_left_alone,
        nonfinite_result_on_one_rank_skips_everywhere,
        overflow_in_newton_schulz_raises_on_every_rank,
        gradient_placements_are_checked_on_every_rank,
        adamw_gradient_on_some_ranks_only_counts_as_zero,
        exception_in_newton_schulz_on_one_rank_is_agreed,
        exception_reading_an_update_on_one_rank_is_agreed,
        dion2_exception_on_one_rank_is_agreed,
        exception_writing_an_update_on_one_rank_is_agreed,
        option_refused_on_one_rank_raises_on_every_rank,
        full_momentum_for_a_sharded_parameter_is_refused,
    )
}


def reliability_worker(rank: int, world_size: int, name: str) -> str:
    logging.getLogger("muon_dist").setLevel(logging.ERROR)
    CHECKS[name]()
    return name


def edge_shape_case() -> Case:
    return Case(
        "edges",
        [
            P((1, 37)),
            P((37, 1)),
            P((3, 700)),
            P((700, 3)),
            P((2, 5)),  # more ranks than rows: empty shards
            P((6, 9), dtype=torch.bfloat16),
            P((5,), kind="adamw"),
        ],
        (dist.get_world_size(),),
        fsdp=True,
    )


def edge_worker(rank: int, world_size: int, precision: str) -> dict[str, float]:
    comm, ns = PRECISIONS[precision]
    return run_case(edge_shape_case(), getattr(torch, comm), getattr(torch, ns), world_size)


def long_run_worker(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Replicated and sharded parameters together for many steps, on every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(7)
    shapes = [(12, 20), (30, 8), (3, 16)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    replicated = [nn.Parameter(f.clone()) for f in fulls]
    sharded = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
    opt = muon_dist.Muon(
        [{"params": replicated + sharded, "algorithm": "muon"}],
        comm_dtype=torch.float32,
        ns_dtype=torch.float32,
    )
    refs = [f.clone() for f in fulls]
    moms = [torch.zeros_like(f) for f in fulls]
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(replicated, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(sharded, grads, strict=True):  # the same on every rank: no scatter
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)], src_data_rank=None)
        opt.step()
        for r, g, m in zip(refs, grads, moms, strict=True):
            reference_muon_step(r, g, m, lr=0.02, ns_dtype=torch.float32)
    for p in replicated:
        gathered = [torch.empty_like(p.detach()) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, p.detach()) for g in gathered), "replicas diverged"
    worst = max(
        ((p.full_tensor() - r).abs().max() / r.abs().max()).item()
        for p, r in zip(sharded, refs, strict=True)
    )
    worst_replicated = max(
        ((p.detach() - r).abs().max() / r.abs().max()).item()
        for p, r in zip(replicated, refs, strict=True)
    )
    return {"sharded": worst, "replicated": worst_replicated}
