"""overlap="backward" and "auto" against the plain step, on FSDP2 models trained on every
rank.

Each case trains the same model twice from the same start, once with each mode, and returns
whether parameters and optimizer state came out bitwise equal (fp32 exchanges and
Newton–Schulz), plus what the case checks about the early start itself.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from packed_maps import packed_only
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import muon_dist
from muon_dist.comm import dion2_exchange, exchange
from muon_dist.step.launch import auto_overlap

IN = 7
# Uneven widths: no dimension divides 2 or 3 ranks, so some shards are uneven or empty.
WIDTHS = (11, 13, 5, 9)


class Experts(nn.Module):
    """A 3-D expert stack ``[E, out, in]``, every expert applied to every row (summed)."""

    def __init__(self, experts: int, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim_out, dim_in) / dim_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eoi->bo", x, self.weight)


def _model(world_size: int, layout: str) -> tuple[nn.Module, list[dict[str, Any]]]:
    """Linear layers (the last with a bias, for AdamW), each its own FSDP2 unit; under
    "experts" a middle layer is an expert stack sharded on the expert dim (whole matrices
    on each rank, as expert parallelism leaves them)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    dim = IN
    for index, width in enumerate(WIDTHS):
        if layout == "experts" and index == 1:
            layers.append(Experts(world_size, dim, width))
        else:
            layers.append(nn.Linear(dim, width, bias=index == len(WIDTHS) - 1))
        dim = width
    model = nn.Sequential(*layers)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in layers:
        if isinstance(layer, Experts):
            fully_shard(layer, mesh=mesh, shard_placement_fn=lambda _p: Shard(0))
        else:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim >= 2 else adamw).append((name, p))
    groups: list[dict[str, Any]] = [
        {
            "params": [p for _, p in muon],
            "param_names": [n for n, _ in muon],
            "experts": layout == "experts",
        },
        {
            "params": [p for _, p in adamw],
            "param_names": [n for n, _ in adamw],
            "algorithm": "adamw",
        },
    ]
    if layout == "experts":
        groups = [
            {"params": [p], "param_names": [n], "experts": p.ndim == 3} for n, p in muon
        ] + groups[1:]
    return model, groups


# Options a layout adds to the optimizer (the model is the "fsdp" one).
OPTIONS: dict[str, dict[str, Any]] = {
    "magma_cautious": {"magma": True, "cautious_wd": True},
    "normuon": {"rule": "normuon"},
    "dion2": {"rule": "dion2"},
    "frozen": {},
    # Advanced in the read unstored, stored at the commit: rounded to bf16 at the same points
    # as the plain step's advance before the buckets.
    "bf16_momentum": {"momentum_dtype": "bf16"},
}


def _optimizer(
    groups: list[dict[str, Any]], overlap: str, nonfinite: str, **options: Any
) -> muon_dist.Muon:
    settings: dict[str, Any] = {
        "weight_decay": 0.1,
        "comm_dtype": torch.float32,
        "ns_dtype": torch.float32,
        "bucket_bytes": 64,  # about a matrix per owner and bucket: several buckets
        "max_inflight": 2,
    }
    return muon_dist.Muon(groups, nonfinite=nonfinite, overlap=overlap, **{**settings, **options})


def _snapshot(model: nn.Module, opt: muon_dist.Muon) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(p.to_local().clone() if isinstance(p, DTensor) else p.clone())
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                tensors.append(local.clone())
    return tensors


def _batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(6, IN, generator=torch.Generator().manual_seed(100 * step + micro))


def _train(
    model: nn.Module,
    opt: muon_dist.Muon,
    steps: int,
    micro_batches: int = 1,
    no_sync: bool = True,
    after_backward: Callable[[int, int], None] | None = None,
) -> None:
    """``steps`` steps of ``micro_batches`` accumulated micro-batches each; with
    ``no_sync`` only the last reduces. ``after_backward(step, micro)`` runs after each."""
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            if no_sync:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            model(_batch(step, micro)).square().mean().backward()
            if after_backward is not None:
                after_backward(step, micro)
        try:
            opt.step()
        except FloatingPointError:
            pass


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def _recording_exchanges() -> Iterator[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each all-to-all this rank starts, as (send splits, receive splits) per peer."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    original = exchange.start_exchange

    def recording(send: Any, sends: Any, recvs: Any, peers: Any) -> Any:
        calls.append((tuple(sends), tuple(recvs)))
        return original(send, sends, recvs, peers)

    with _exchanges_through(recording):
        yield calls


@contextlib.contextmanager
def _exchanges_through(replacement: Any) -> Iterator[None]:
    """Both transports (plain and Dion2's) start their all-to-alls through ``replacement``."""
    original = exchange.start_exchange
    modules = (exchange, dion2_exchange)
    for module in modules:
        module.start_exchange = replacement  # type: ignore[assignment]
    try:
        yield
    finally:
        for module in modules:
            module.start_exchange = original  # type: ignore[assignment]


def parity(world_size: int, layout: str) -> dict[str, Any]:
    """Three steps with and without overlap; the plain run's buckets by cost, the
    overlapped one's in backward order."""
    snapshots = []
    started: list[int] = []
    held: list[int] = []
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp" if layout in OPTIONS else layout)
        if layout == "frozen":  # a Muon parameter without a gradient, hence without a hook
            model[0].weight.requires_grad_(False)
        opt = _optimizer(groups, overlap, "raise", **OPTIONS.get(layout, {}))

        def record(_step: int, _micro: int, opt: muon_dist.Muon = opt) -> None:
            if opt.runner.early is not None:
                started.append(opt.runner.early.started)
                held.append(opt.runner.early.held_bytes)

        with _recording_exchanges() as exchanges:
            _train(model, opt, 3, after_backward=record)
        snapshots.append(_snapshot(model, opt))
    buckets = len(opt.runner.muon.plan.buckets) if opt.runner.muon is not None else 0
    # fp32 exchanges: the local shards of the Muon tensors, in bytes.
    shards = sum(p.to_local().numel() * 4 for g in groups[:-1] for p in g["params"])
    return {
        "equal": _equal(*snapshots),
        "started": started,
        "buckets": buckets,
        "held": held,
        "shard_bytes": shards,
        "exchanges": exchanges,  # of the overlapped run
        "redone": opt.runner.early.redone if opt.runner.early is not None else 0,
    }


def accumulation(world_size: int, no_sync: bool) -> dict[str, Any]:
    """Two micro-batches per step: with ``set_requires_gradient_sync(False)`` on the first
    nothing starts before the last; without it the first's start is dropped and redone."""
    snapshots = []
    started: list[tuple[int, int]] = []
    restarts = 0
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp")
        opt = _optimizer(groups, overlap, "raise")

        def record(_step: int, micro: int, opt: muon_dist.Muon = opt) -> None:
            if opt.runner.early is not None:
                started.append((micro, opt.runner.early.started))

        _train(model, opt, 2, micro_batches=2, no_sync=no_sync, after_backward=record)
        snapshots.append(_snapshot(model, opt))
        if opt.runner.early is not None:
            restarts = opt.runner.early.restarts
    return {"equal": _equal(*snapshots), "started": started, "restarts": restarts}


def nonfinite(world_size: int, policy: str, target: str) -> dict[str, Any]:
    """A NaN on rank 0 in the gradient of the last layer (first bucket) or of the first
    layer (last bucket) in the second of three steps: both modes leave parameters and
    state as they were in that step, and end bitwise equal."""
    bad_step = 1
    snapshots = []
    unchanged = []
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp")
        layer = model[len(WIDTHS) - 1] if target == "last" else model[0]
        current = [0]  # the step whose backward runs

        def poison(p: torch.Tensor, current: list[int] = current) -> None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if current[0] == bad_step and torch.distributed.get_rank() == 0 and grad.numel():
                grad.view(-1)[0] = math.nan

        # Registered before the optimizer's hook, so the early start reads the NaN.
        layer.weight.register_post_accumulate_grad_hook(poison)
        opt = _optimizer(groups, overlap, policy)
        for step in range(3):
            current[0] = step
            opt.zero_grad()
            model(_batch(step, 0)).square().mean().backward()
            before = _snapshot(model, opt)
            try:
                opt.step()
            except FloatingPointError:
                pass
            if step == bad_step:
                unchanged.append(_equal(before, _snapshot(model, opt)))
        snapshots.append(_snapshot(model, opt))
    return {"equal": _equal(*snapshots), "unchanged": unchanged}


def resume(world_size: int) -> dict[str, Any]:
    """Two steps, DCP state dicts loaded into a fresh model and optimizer, one more step,
    in each mode: the resumed runs are bitwise equal across modes, and the overlapped one
    started buckets during backward after the load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    snapshots = []
    started = 0
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp")
        opt = _optimizer(groups, overlap, "raise")
        _train(model, opt, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        fresh, fresh_groups = _model(world_size, "fsdp")
        fresh_opt = _optimizer(fresh_groups, overlap, "raise")
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        fresh_opt.zero_grad()
        fresh(_batch(2, 0)).square().mean().backward()
        if fresh_opt.runner.early is not None:
            started = fresh_opt.runner.early.started
        fresh_opt.step()
        snapshots.append(_snapshot(fresh, fresh_opt))
    return {"equal": _equal(*snapshots), "started": started}


def repeated_step(world_size: int) -> dict[str, Any]:
    """A backward and step, step() again on the same gradients (no backward between, so no
    hook ran), then another backward and step: both modes end bitwise equal."""
    snapshots = []
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp")
        opt = _optimizer(groups, overlap, "raise")
        for step in range(2):
            opt.zero_grad()
            model(_batch(step, 0)).square().mean().backward()
            opt.step()
            if step == 0:
                opt.step()
        snapshots.append(_snapshot(model, opt))
    return {"equal": _equal(*snapshots)}


def _scale_grads(model: nn.Module, factor: float) -> None:
    for p in model.parameters():
        p.grad.mul_(factor)


def _set_momentum(opt: muon_dist.Muon, value: float) -> None:
    opt.param_groups[0]["momentum"] = value


# Edits between backward and step() (all on every rank but the last): the step must still be
# the plain mode's. Each takes (model, opt, step) and edits at step 1.
EDITS: dict[str, Callable[[nn.Module, muon_dist.Muon], None]] = {
    "clip_grad_norm_": lambda model, _opt: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
    "grad.mul_": lambda model, _opt: _scale_grads(model, 0.5),
    "zero_grad(set_to_none=False)": lambda _model, opt: opt.zero_grad(set_to_none=False),
    "momentum": lambda _model, opt: _set_momentum(opt, 0.8),
    "nesterov": lambda _model, opt: opt.param_groups[0].update(nesterov=False),
    "ns_steps": lambda _model, opt: opt.param_groups[0].update(ns_steps=3),
    "grad.mul_ on rank 0": lambda model, _opt: (
        _scale_grads(model, 0.5) if torch.distributed.get_rank() == 0 else None
    ),
}


def edited(world_size: int) -> dict[str, Any]:
    """Each of ``EDITS`` at step 1 of 3, and a gradient hook registered after the
    optimizer's that scales each gradient during backward: both modes end bitwise equal,
    and the overlapped one ran its started buckets again where they read the edit."""
    results: dict[str, Any] = {}
    for name in [*EDITS, "later hook"]:
        snapshots = []
        redone = 0
        for overlap in ("none", "backward"):
            model, groups = _model(world_size, "fsdp")
            opt = _optimizer(groups, overlap, "raise")
            if name == "later hook":
                for p in model.parameters():
                    p.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))

            def edit(
                step: int, _micro: int, model: nn.Module = model, opt: Any = opt, name: str = name
            ) -> None:
                if step == 1 and name in EDITS:
                    EDITS[name](model, opt)

            _train(model, opt, 3, after_backward=edit)
            snapshots.append(_snapshot(model, opt))
            early = opt.runner.early
            redone = 0 if early is None else early.redone
        results[name] = {"equal": _equal(*snapshots), "redone": redone}
    return results


# Per scenario: the layers whose gradients are scaled in place between backward and step(),
# whether layer 0 is frozen, and the bucket size. "started": the last layer's gradient, read
# by the first bucket, which starts during backward. "not_started": layer 0 has no gradient
# and every matrix shares one bucket, which therefore starts only at step().
ONE_EDIT: dict[str, tuple[tuple[int, ...], bool, int]] = {
    "started": ((len(WIDTHS) - 1,), False, 64),
    "not_started": (tuple(range(1, len(WIDTHS))), True, 1 << 20),
}


def edited_where(world_size: int, scenario: str) -> dict[str, Any]:
    """``ONE_EDIT[scenario]`` at step 1 of 3: both modes end bitwise equal, and the
    overlapped run redid its started buckets only where they read an edited gradient."""
    layers, frozen, bucket_bytes = ONE_EDIT[scenario]
    snapshots = []
    started: list[int] = []
    redone = 0
    for overlap in ("none", "backward"):
        model, groups = _model(world_size, "fsdp")
        if frozen:
            model[0].weight.requires_grad_(False)
        opt = _optimizer(groups, overlap, "raise", bucket_bytes=bucket_bytes)

        def edit(step: int, _micro: int, model: nn.Module = model, opt: Any = opt) -> None:
            if opt.runner.early is not None:
                started.append(opt.runner.early.started)
            if step == 1:
                for layer in layers:
                    model[layer].weight.grad.mul_(0.5)

        _train(model, opt, 3, after_backward=edit)
        snapshots.append(_snapshot(model, opt))
        redone = 0 if opt.runner.early is None else opt.runner.early.redone
    return {"equal": _equal(*snapshots), "started": started, "redone": redone}


def changed_on_one_rank(world_size: int) -> dict[str, Any]:
    """Rank 0 sets a group's momentum between backward and step(): its started buckets
    read the old one; every rank runs them again and refuses the step, nothing changed."""
    model, groups = _model(world_size, "fsdp")
    opt = _optimizer(groups, "backward", "raise")
    errors: list[str] = []
    unchanged = False
    for step in range(3):
        opt.zero_grad()
        model(_batch(step, 0)).square().mean().backward()
        if step == 1 and torch.distributed.get_rank() == 0:
            _set_momentum(opt, 0.8)
        before = _snapshot(model, opt)
        try:
            opt.step()
        except RuntimeError as exc:
            errors.append(str(exc))
            unchanged = _equal(before, _snapshot(model, opt))
            _set_momentum(opt, 0.95)
    finite = all(bool(torch.isfinite(t).all()) for t in _snapshot(model, opt))
    return {"errors": errors, "unchanged": unchanged, "finite": finite}


def early_gather(world_size: int) -> dict[str, Any]:
    """The first gather is issued during backward, before the first layer's gradient
    (the last backward finishes) is reduced, and it is the last layer's bucket's."""
    model, groups = _model(world_size, "fsdp")
    opt = _optimizer(groups, "backward", "raise")
    events: list[str] = []
    original = exchange.start_exchange

    def recording(*args: Any, **kwargs: Any) -> Any:
        events.append("exchange")
        return original(*args, **kwargs)

    model[0].weight.register_post_accumulate_grad_hook(lambda _p: events.append("first layer"))
    with _exchanges_through(recording):
        model(_batch(0, 0)).square().mean().backward()
        events.append("backward done")
        opt.step()
    muon = opt.runner.muon
    assert muon is not None
    last_layer = f"{len(WIDTHS) - 1}.weight"
    return {
        "events": events,
        "first_bucket_names": list(muon.plan.buckets[0].names),
        "last_layer": last_layer,
    }


class ScriptedClock:
    """A step clock whose trial steps take ``seconds[mode]`` each: overlap="auto" with this
    rank's timings chosen by the test, not measured."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds_of = seconds
        self._marks: list[float] = []

    def mark(self) -> None:
        # Mark k ends step WARMUP_STEPS - 1 + k (the schedule's marked steps, in order).
        mode = auto_overlap.trial_mode(auto_overlap.WARMUP_STEPS - 1 + len(self._marks))
        assert mode is not None, "marked after the decision"
        self._marks.append((self._marks[-1] if self._marks else 0.0) + self.seconds_of[mode])

    def seconds(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._marks)]


# Per scenario, per rank: the seconds a trial step of each mode takes (binary fractions, so
# the clock's sums and differences are exact).
AUTO_TIMES: dict[str, list[dict[str, float]]] = {
    "overlap_faster": [{"none": 1.0, "backward": 0.5}, {"none": 1.25, "backward": 0.75}],
    "plain_faster": [{"none": 0.5, "backward": 1.0}, {"none": 0.75, "backward": 0.875}],
    # Rank 0 alone would overlap; rank 1's overlapped steps are the slowest of all.
    "ranks_differ": [{"none": 1.0, "backward": 0.875}, {"none": 0.75, "backward": 1.25}],
    "tie": [{"none": 1.0, "backward": 1.0}, {"none": 1.0, "backward": 1.0}],
}


def auto_choice(world_size: int, scenario: str) -> dict[str, Any]:
    """overlap="auto" with this rank's ``AUTO_TIMES``, two steps past the decision: before
    each backward whether the step overlaps, after it how many buckets started, the mode
    shown during each step and the device values step() read on the host; then the choice
    and the agreed medians."""
    from test_host_sync import count_host_reads

    model, groups = _model(world_size, "fsdp")
    opt = _optimizer(groups, "auto", "raise")
    early = opt.runner.early
    assert early is not None
    opt.overlap_choice.clock = ScriptedClock(AUTO_TIMES[scenario][torch.distributed.get_rank()])
    overlapping, started, modes, reads = [], [], [], []
    for step in range(auto_overlap.DECISION_STEP + 3):
        opt.zero_grad()
        overlapping.append(opt.overlap_choice.overlapping)
        modes.append(opt.overlap_mode)
        model(_batch(step, 0)).square().mean().backward()
        started.append(early.started)
        with count_host_reads() as calls:
            opt.step()
        reads.append(len(calls))
    return {
        "overlapping": overlapping,
        "started": started,
        "modes": modes,
        "reads": reads,
        "chosen": opt.overlap_mode,
        "medians": opt.overlap_choice.medians,
    }


def _interrupt() -> None:
    raise KeyboardInterrupt


def auto_parity(world_size: int) -> dict[str, Any]:
    """overlap="auto" (a clock that makes the overlap faster, so the steps after the decision
    overlap too) against "none" over warm-up, trials, decision and beyond, with the same
    events in both runs: ``ns_steps`` set between backward and step() of an overlapped
    trial step (the step is rebuilt); an overlapped trial step whose step() raises before
    its Muon phase (a closure's KeyboardInterrupt, as CUDA's deferred FloatingPointError
    does at the start of step()), followed by a plain one; a state_dict round trip after
    the decision (rebuilt again). The auto run keeps its count and choice throughout."""
    edit_step, raised_step, load_step = 4, 8, auto_overlap.DECISION_STEP + 2
    assert auto_overlap.trial_mode(edit_step) == auto_overlap.trial_mode(raised_step) == "backward"
    assert auto_overlap.trial_mode(raised_step + 1) == "none"
    snapshots = []
    started: list[int] = []
    runners = 0
    for overlap in ("none", "auto"):
        model, groups = _model(world_size, "fsdp")
        opt = _optimizer(groups, overlap, "raise")
        if overlap == "auto":
            opt.overlap_choice.clock = ScriptedClock({"none": 1.0, "backward": 0.5})
        seen: list[Any] = []  # each step runner in turn (kept, so no id is reused)
        for step in range(auto_overlap.DECISION_STEP + 4):
            if step == load_step:
                opt.load_state_dict(opt.state_dict())
            opt.zero_grad()
            model(_batch(step, 0)).square().mean().backward()
            if overlap == "auto":
                started.append(opt.runner.early.started)
            if step == edit_step:
                opt.param_groups[0]["ns_steps"] = 3
            try:
                opt.step(_interrupt if step == raised_step else None)
            except KeyboardInterrupt:
                pass
            if not seen or seen[-1] is not opt.runner:
                seen.append(opt.runner)
        snapshots.append(_snapshot(model, opt))
        runners = len(seen)
    return {
        "equal": _equal(*snapshots),
        "started": started,
        "mode": opt.overlap_mode,
        "runners": runners,
        "steps": opt.overlap_choice.steps,
        "raised_step": raised_step,
    }


def in_place(world_size: int) -> dict[str, Any]:
    """overlap="backward" under ``skip_step`` with the exchange's buffers as stacks where the
    plan allows (plan/in_place.py) and all packed: bitwise equal, and what waits for
    ``step()`` is still at most this rank's pieces of the updates."""
    snapshots = []
    held: list[int] = []
    counts = []
    for packed in (False, True):
        with packed_only() if packed else contextlib.nullcontext():
            model, groups = _model(world_size, "fsdp")
            opt = _optimizer(groups, "backward", "skip_step")

            def record(_step: int, _micro: int, opt: muon_dist.Muon = opt) -> None:
                if opt.runner.early is not None:
                    held.append(opt.runner.early.held_bytes)

            _train(model, opt, 3, after_backward=record)
        snapshots.append(_snapshot(model, opt))
        assert opt.runner.muon is not None
        counts.append(sum(m.gather_in_place + m.scatter_in_place for m in opt.runner.muon.maps))
    shards = sum(p.to_local().numel() * 4 for g in groups[:-1] for p in g["params"])
    return {"equal": _equal(*snapshots), "in_place": counts, "held": held, "shard_bytes": shards}


def overlap_worker(rank: int, world_size: int, case: str, *args: Any) -> dict[str, Any]:
    cases: dict[str, Callable[..., dict[str, Any]]] = {
        "parity": parity,
        "accumulation": accumulation,
        "nonfinite": nonfinite,
        "early_gather": early_gather,
        "edited": edited,
        "edited_where": edited_where,
        "changed_on_one_rank": changed_on_one_rank,
        "resume": resume,
        "repeated_step": repeated_step,
        "auto_choice": auto_choice,
        "auto_parity": auto_parity,
        "in_place": in_place,
    }
    return cases[case](world_size, *args)
