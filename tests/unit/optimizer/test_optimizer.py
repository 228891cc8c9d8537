"""Single-process Muon: the update rule, matrix views, AdamW groups, state and validation."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from reference_muon import reference_muon_step, step_with_grads
from torch import nn

import muon_dist
from muon_dist.plan.views import matrix_view
from muon_dist.step.program.binding import fusable

# Exact comparisons run Newton–Schulz in fp32: bf16 products round with the batch shape.
FP32 = {"comm_dtype": torch.float32, "ns_dtype": torch.float32}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
def test_muon_step_matches_direct_computation(nesterov: bool, adjust_lr: str | None) -> None:
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 40), (33, 33)]
    fulls = [torch.randn(s) for s in shapes]
    params = [nn.Parameter(f.clone()) for f in fulls]
    opt = muon_dist.Muon(
        [{"params": params, "algorithm": "muon"}],
        lr=0.03,
        momentum=0.9,
        nesterov=nesterov,
        weight_decay=0.05,
        adjust_lr=adjust_lr,
        **FP32,
    )
    refs = [f.clone() for f in fulls]
    moms = [torch.zeros_like(f) for f in fulls]
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        step_with_grads(opt, params, grads)
        for r, g, m in zip(refs, grads, moms, strict=True):
            reference_muon_step(
                r,
                g,
                m,
                lr=0.03,
                momentum=0.9,
                nesterov=nesterov,
                weight_decay=0.05,
                adjust_lr=adjust_lr,
                ns_dtype=torch.float32,
            )
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=0, atol=1e-6)


def test_expert_stack_and_fused_equal_separate_matrices() -> None:
    torch.manual_seed(1)
    experts, rows, cols = 3, 20, 12  # rows > cols: the spectral lr scale is not 1
    separate = [nn.Parameter(torch.randn(rows, cols)) for _ in range(experts)]
    stack = nn.Parameter(torch.stack([p.detach() for p in separate]))
    fused = nn.Parameter(torch.cat([p.detach() for p in separate]))
    opt_sep = muon_dist.Muon([{"params": separate, "algorithm": "muon"}], lr=0.05, **FP32)
    opt_stack = muon_dist.Muon(
        [{"params": [stack], "algorithm": "muon", "experts": True}], lr=0.05, **FP32
    )
    opt_fused = muon_dist.Muon(
        [{"params": [fused], "algorithm": "muon", "num_experts": experts}], lr=0.05, **FP32
    )
    for _ in range(2):
        grads = [torch.randn(rows, cols) for _ in range(experts)]
        step_with_grads(opt_sep, separate, grads)
        step_with_grads(opt_stack, [stack], [torch.stack(grads)])
        step_with_grads(opt_fused, [fused], [torch.cat(grads)])
    expected = torch.stack([p.detach() for p in separate])
    torch.testing.assert_close(stack.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(fused.detach(), expected.reshape(-1, cols), rtol=0, atol=1e-6)


def test_flat_and_slice_views() -> None:
    flat = matrix_view((8, 3, 2, 5), muon_mode="flat")
    assert (flat.count, flat.rows, flat.cols) == (1, 8, 30)
    sliced = matrix_view((4, 6, 2, 5), muon_mode="slice")
    assert (sliced.count, sliced.rows, sliced.cols) == (4, 6, 10)
    assert sliced.box(1, 3) == ((1, 3), (0, 6), (0, 2), (0, 5))
    fused = matrix_view((12, 5), num_experts=3)
    assert (fused.count, fused.rows, fused.box(1, 2)) == (3, 4, ((4, 8), (0, 5)))

    torch.manual_seed(2)
    for mode, matrices in (("flat", (1, 8, 30)), ("slice", (8, 3, 10))):
        full = torch.randn(8, 3, 2, 5)
        grad = torch.randn(8, 3, 2, 5)
        p = nn.Parameter(full.clone())
        opt = muon_dist.Muon(
            [{"params": [p], "algorithm": "muon", "muon_mode": mode}], lr=0.1, **FP32
        )
        step_with_grads(opt, [p], [grad])
        ref = full.clone()
        reference_muon_step(
            ref, grad, torch.zeros_like(ref), lr=0.1, matrices=matrices, ns_dtype=torch.float32
        )
        torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-6)


def test_adamw_groups_match_torch_adamw() -> None:
    torch.manual_seed(3)
    fulls = [torch.randn(10), torch.randn(7, 5), torch.randn(())]
    ours = [nn.Parameter(f.clone()) for f in fulls]
    theirs = [nn.Parameter(f.clone()) for f in fulls]
    opt = muon_dist.Muon(
        [
            {
                "params": ours,
                "algorithm": "adamw",
                "lr": 1e-2,
                "betas": (0.8, 0.99),
                "weight_decay": 0.1,
            }
        ]
    )
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, eps=1e-8)
    for _ in range(5):
        grads = [torch.randn_like(f) for f in fulls]
        step_with_grads(opt, ours, grads)
        step_with_grads(ref, theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def _model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 6))


@pytest.mark.parametrize("magma", [False, True])
def test_state_dict_round_trip_continues_exactly(magma: bool) -> None:
    inputs = [torch.randn(5, 12, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def train(model: nn.Module, opt: torch.optim.Optimizer, batch: list[torch.Tensor]) -> None:
        for x in batch:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    model = _model()
    train(model, muon_dist.Muon(model.named_parameters(), lr=0.02, magma=magma), inputs)
    uninterrupted = copy.deepcopy(model.state_dict())

    model = _model()
    opt = muon_dist.Muon(model.named_parameters(), lr=0.02, magma=magma)
    train(model, opt, inputs[:3])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert ("magma_score" in saved_opt["state"][0]) is magma
    model = _model()
    model.load_state_dict(saved_model)
    opt = muon_dist.Muon(model.named_parameters(), lr=0.02, magma=magma)
    opt.load_state_dict(saved_opt)
    train(model, opt, inputs[3:])
    for key, value in uninterrupted.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


def test_state_is_created_eagerly_and_schedulers_closures_work() -> None:
    model = _model()
    opt = muon_dist.Muon(model.parameters(), lr=0.02)
    state = opt.state_dict()["state"]
    assert len(state) == 6
    assert {"momentum_buffer"} == set(state[1]) and {"step", "exp_avg", "exp_avg_sq"} == set(
        state[2]
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(3, 12)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.isfinite(loss)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 1.5e-4]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"algorithm": "muon", "coefficients": "cubic"}, "coefficients='cubic'"),
        ({"algorithm": "muon", "muon_mode": "3d"}, "muon_mode='3d'"),
        ({"algorithm": "muon", "ns_method": "fast"}, "ns_method=.fast."),
        ({"algorithm": "adamw", "ns_method": "gram"}, "ns_method=.gram. is a Muon option"),
        ({"algorithm": "muon", "adjust_lr": "max"}, "adjust_lr='max'"),
        ({"algorithm": "sgd"}, "algorithm='sgd'"),
        ({"algorithm": "muon", "lr": -1.0}, "lr=-1.0"),
        ({"algorithm": "adamw", "lr": -1.0}, "lr=-1.0"),
        ({"algorithm": "muon", "momentum": 1.0}, "momentum=1.0"),
        ({"algorithm": "muon", "momentum": -0.1}, "momentum=-0.1"),
        ({"algorithm": "adamw", "betas": (0.9, 1.5)}, r"betas\[1\]=1.5"),
    ],
)
def test_bad_group_options_raise(group: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.Muon([{"params": [nn.Parameter(torch.randn(4, 4))], **group}])


@pytest.mark.parametrize(
    ("shape", "group", "message"),
    [
        ((8,), {}, r"shape \(8,\): Muon needs >= 2-D"),
        ((2, 3, 4), {}, "set experts=True"),
        ((2, 3, 4, 5), {"experts": True}, "muon_mode='flat'"),
        ((10, 4), {"num_experts": 3}, "not divisible by num_experts=3"),
    ],
)
def test_bad_parameters_in_muon_groups_raise(
    shape: tuple[int, ...], group: dict[str, object], message: str
) -> None:
    p = nn.Parameter(torch.randn(shape))
    with pytest.raises(ValueError, match=message) as info:
        muon_dist.Muon(
            [{"params": [p], "param_names": ["blocks.0.w"], "algorithm": "muon", **group}]
        )
    assert "blocks.0.w" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "cuda"}, "backend='cuda'"),
        ({"comm_dtype": torch.float16}, "comm_dtype"),
        ({"bucket_bytes": 0}, "bucket_bytes=0"),
        ({"max_inflight": 0}, "max_inflight=0"),
        ({"replica_mode": "mirror"}, "replica_mode='mirror'"),
        ({"cuda_graph": True}, "cuda_graph=True captures CUDA work"),
    ],
)
def test_bad_optimizer_options_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.Muon([nn.Parameter(torch.randn(4, 4))], **kwargs)  # type: ignore[arg-type]


def test_plain_parameters_split_by_dimension() -> None:
    model = _model()
    opt = muon_dist.Muon(model.named_parameters())
    algorithms = {name: g["algorithm"] for g in opt.param_groups for name in g["param_names"]}
    assert algorithms == {
        "0.weight": "muon",
        "2.weight": "muon",
        "0.bias": "adamw",
        "1.weight": "adamw",
        "1.bias": "adamw",
        "2.bias": "adamw",
    }
    adamw = next(g for g in opt.param_groups if g["algorithm"] == "adamw")
    assert adamw["lr"] == 3e-4 and "momentum" not in adamw


def test_lr_scale_uses_full_shape() -> None:
    view = matrix_view((4096, 1024))
    assert view.lr_scale("spectral_norm") == 2.0
    assert view.lr_scale("rms_norm") == pytest.approx(0.2 * math.sqrt(4096))
    experts = matrix_view((8, 64, 16), experts=True)
    assert experts.lr_scale("spectral_norm") == 2.0


def test_passes_fuse_only_where_a_shard_is_read_or_written_once() -> None:
    """Momentum rides along the input read, and decay along the update write, only where
    nothing else needs them first: not under Magma (cosines of the advanced momentum, per-row
    steps) nor cautious decay (the update's sign)."""
    plain, magma, cautious = (nn.Parameter(torch.randn(12, 8)) for _ in range(3))
    split = nn.Parameter(torch.randn(12, 8))
    opt = muon_dist.Muon(
        [
            {"params": [plain], "algorithm": "muon"},
            {"params": [magma], "algorithm": "muon", "magma": True},
            {"params": [cautious], "algorithm": "muon", "cautious_wd": True},
            {"params": [split], "algorithm": "muon", "split_sizes": [4, 8]},
        ],
        weight_decay=0.1,
    )
    muon = opt.runner.muon
    assert muon is not None
    entries = muon.tensors.entries
    labels = [e.name for e in entries]
    reads, writes = fusable(muon.plan, muon.tensors)
    fused_reads = {labels[i] for i in reads}
    fused_writes = {labels[i] for i in writes}
    split_views = {"group3.param0[0:4]", "group3.param0[4:12]"}
    assert len(entries) == 5 and split_views <= set(labels)
    assert fused_reads == {"group0.param0", "group2.param0", *split_views}
    assert fused_writes == {"group0.param0", *split_views}


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 10).t(),  # transposed: dense, not contiguous
        lambda: torch.randn(8, 12)[:, :5],  # a slice of a larger tensor
        lambda: torch.randn(6, 10)[:, ::2],  # every other column
    ],
    ids=["transposed", "slice", "strided"],
)
def test_adamw_on_strided_parameters_matches_torch(make: Callable[[], torch.Tensor]) -> None:
    """A parameter that is a strided view updates as torch's single-tensor AdamW updates a
    contiguous copy, and stays a view of the tensor it was cut from."""
    torch.manual_seed(3)
    base = make()
    param = nn.Parameter(base)
    reference = nn.Parameter(base.detach().clone())
    opt = muon_dist.Muon(
        [{"params": [param], "algorithm": "adamw"}], adamw_lr=1e-2, adamw_weight_decay=0.1
    )
    ref = torch.optim.AdamW(
        [reference], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
    )
    for _ in range(3):
        grad = torch.randn(param.shape)
        param.grad, reference.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-6)
    assert param.data_ptr() == base.data_ptr() and param.stride() == base.stride()
