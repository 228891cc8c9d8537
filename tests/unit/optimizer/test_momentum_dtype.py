"""``momentum_dtype`` (issue 56): Muon's momenta stored in bf16, the arithmetic in fp32.

With ``"bf16"`` the state takes half the bytes and each step equals single-device Muon whose
momentum is rounded to bf16 after each advance (``bf16_momentum_reference``, written from
the algorithm), under Muon, NorMuon and Dion2; the default keeps each momentum in its
parameter's dtype; a checkpoint resumes bitwise, and one saved under another
``momentum_dtype`` loads cast, with a warning.

The bound, ``EXACT``: the optimizer and the reference advance the momentum with the same
fp32 add and round it at the same points, so their momenta come out equal (checked
bitwise) and their updates differ only by the rounding of fp32 Newton–Schulz against the
reference's float64 one, the parity tests' exact bound (measured at most 2.1e-6, here and
on two ranks). Rounding the momentum to bf16 moves an update by about 1e-3 (a reference
that keeps it in fp32 is 5e-4 to 2.3e-3 away), so a rounding point moved, added or missed
fails it by far: each test also checks that the fp32 reference is at least ``SEEN`` away.
"""

from __future__ import annotations

import copy
import io
import logging
from typing import Any

import pytest
import torch
from bf16_momentum_reference import Hyper, relative, step
from reference_muon import reference_muon_step
from torch import nn

import muon_dist
from muon_dist.state.flat import ALIGN_BYTES

EXACT = 1e-5
# The bf16 rounding every comparison must be able to see: at least 10x the bound.
SEEN = 10 * EXACT
SHAPES = [(16, 24), (40, 12), (33, 33)]
HYPER = Hyper()
FP32 = {"ns_dtype": torch.float32, "comm_dtype": torch.float32}
STEPS = 4


def _optimizer(params: list[nn.Parameter], **options: Any) -> muon_dist.Muon:
    return muon_dist.Muon(
        [(f"w{i}", p) for i, p in enumerate(params)],
        lr=HYPER.lr,
        momentum=HYPER.momentum,
        weight_decay=HYPER.weight_decay,
        **FP32,
        **options,
    )


def _data(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    starts = [torch.randn(s, generator=gen) for s in SHAPES]
    return starts, [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]


def _run(opt: muon_dist.Muon, params: list[nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nonfinite", ["raise", "skip_step"])
@pytest.mark.parametrize("rule", ["muon", "normuon", "dion2"])
def test_bf16_momentum_steps_as_the_bf16_reference(rule: str, nonfinite: str) -> None:
    """Both places a momentum advances: stored before the buckets and mixed from the stored
    value (a plain step), or advanced in the read and stored at the commit (a step that
    may still be skipped)."""
    starts, grads = _data()
    params = [nn.Parameter(s.clone()) for s in starts]
    opt = _optimizer(params, rule=rule, momentum_dtype="bf16", nonfinite=nonfinite)
    runner = opt.runner
    _run(opt, params, grads)
    assert opt.runner is runner, "a bf16 momentum is no parameter move: the step is not rebuilt"
    for i, (p, start) in enumerate(zip(params, starts, strict=True)):
        state = opt.state[p]
        assert state["momentum_buffer"].dtype == torch.bfloat16
        if rule == "normuon":
            assert state["row_second_moment"].dtype == torch.float32
        far = {}
        for store in (torch.bfloat16, torch.float32):
            want, momentum = start.clone(), torch.zeros(SHAPES[i], dtype=store)
            moment = torch.zeros(SHAPES[i][0])
            for step_grads in grads:
                step(
                    want, step_grads[i], momentum, HYPER, rule=rule, store=store, row_moment=moment
                )
            far[store] = relative(p.detach(), want, start)
            if store == torch.bfloat16:
                assert torch.equal(state["momentum_buffer"], momentum), f"w{i} momentum"
                if rule == "normuon":
                    torch.testing.assert_close(state["row_second_moment"], moment)
        assert far[torch.bfloat16] <= EXACT, f"w{i}: {far}"
        assert far[torch.float32] >= SEEN, f"w{i}: the bf16 rounding is not seen: {far}"


def test_magma_and_cautious_decay_read_the_bf16_momentum() -> None:
    """Magma's score from the stored bf16 momentum and cautious decay (their own passes, no
    fused form) step as ``reference_muon_step`` given a bf16 momentum buffer, which it
    rounds to after each advance."""
    starts, grads = _data(5)
    params = [nn.Parameter(s.clone()) for s in starts]
    opt = _optimizer(params, magma=True, cautious_wd=True, momentum_dtype="bf16")
    _run(opt, params, grads)
    for i, (p, start) in enumerate(zip(params, starts, strict=True)):
        far = {}
        for store in (torch.bfloat16, torch.float32):
            want, momentum, score = (
                start.clone(),
                torch.zeros(SHAPES[i], dtype=store),
                torch.ones(1),
            )
            for step_grads in grads:
                reference_muon_step(
                    want,
                    step_grads[i],
                    momentum,
                    lr=HYPER.lr,
                    momentum=HYPER.momentum,
                    weight_decay=HYPER.weight_decay,
                    ns_dtype=torch.float32,
                    magma_score=score,
                    cautious_wd=True,
                )
            far[store] = relative(p.detach(), want, start)
            if store == torch.bfloat16:
                assert torch.equal(opt.state[p]["momentum_buffer"], momentum), f"w{i}"
                torch.testing.assert_close(opt.state[p]["magma_score"], score)
        assert far[torch.bfloat16] <= EXACT and far[torch.float32] >= SEEN, f"w{i}: {far}"


def _momentum_bytes(opt: muon_dist.Muon, key: str = "momentum_buffer") -> int:
    storages = {
        id(s): s.nbytes()
        for entry in opt.state.values()
        if key in entry
        for s in [entry[key].untyped_storage()]
    }
    return sum(storages.values())


def test_bf16_momenta_take_half_the_bytes_and_the_rest_stays_fp32() -> None:
    """The momenta halve (the group's flat buffer too, up to alignment); NorMuon's row
    moments and AdamW's moments keep fp32."""
    opts = {}
    for dtype in (None, "bf16"):
        weights = [nn.Parameter(torch.randn(s)) for s in SHAPES]
        bias = nn.Parameter(torch.randn(7))
        groups = [
            {"params": weights, "param_names": ["a", "b", "c"], "algorithm": "muon"},
            {"params": [bias], "param_names": ["bias"], "algorithm": "adamw"},
        ]
        opts[dtype] = muon_dist.Muon(groups, rule="normuon", momentum_dtype=dtype)
        state = opts[dtype].state
        assert all(state[w]["row_second_moment"].dtype == torch.float32 for w in weights)
        assert state[bias]["exp_avg"].dtype == state[bias]["exp_avg_sq"].dtype == torch.float32
    assert all(
        opts[None].state[p]["momentum_buffer"].dtype == torch.float32
        for p in opts[None].param_groups[0]["params"]
    )
    held = {
        dtype: sum(opt.state[p]["momentum_buffer"].nbytes for p in opt.param_groups[0]["params"])
        for dtype, opt in opts.items()
    }
    assert held["bf16"] * 2 == held[None]
    # The flat buffer too, up to each view's alignment padding (ALIGN_BYTES).
    padding = ALIGN_BYTES * len(SHAPES)
    assert _momentum_bytes(opts["bf16"]) <= _momentum_bytes(opts[None]) // 2 + padding


def test_the_default_keeps_each_parameter_dtype_and_fp32_names_it() -> None:
    """None: an fp32 parameter's momentum is fp32, a bf16 one's bf16 (as before the option).
    ``"fp32"`` on fp32 parameters is the default, bitwise; on a bf16 parameter it keeps an
    fp32 momentum, advanced from the bf16 gradients without rounding."""
    opt = muon_dist.Muon(
        [("a", nn.Parameter(torch.randn(6, 8))), ("b", nn.Parameter(torch.randn(6, 8).bfloat16()))]
    )
    assert [opt.state[p]["momentum_buffer"].dtype for p in opt.param_groups[0]["params"]] == [
        torch.float32,
        torch.bfloat16,
    ]
    starts, grads = _data(1)
    results = []
    for dtype in (None, "fp32"):
        params = [nn.Parameter(s.clone()) for s in starts]
        _run(_optimizer(params, momentum_dtype=dtype), params, grads)
        results.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))

    weight = nn.Parameter(starts[0].bfloat16())
    opt = _optimizer([weight], momentum_dtype="fp32")
    want = torch.zeros(SHAPES[0])
    for step_grads in grads:
        weight.grad = step_grads[0].bfloat16()
        opt.step()
        want = torch.add(step_grads[0].bfloat16().float(), want, alpha=HYPER.momentum)
    assert opt.state[weight]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt.state[weight]["momentum_buffer"], want)


def _saved(opt: muon_dist.Muon) -> dict[str, Any]:
    """The state as a checkpoint holds it: through torch.save and torch.load."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


@pytest.mark.parametrize("rule", ["muon", "dion2"])
def test_a_bf16_checkpoint_resumes_bitwise(rule: str) -> None:
    starts, grads = _data(2)
    params = [nn.Parameter(s.clone()) for s in starts]
    opt = _optimizer(params, rule=rule, momentum_dtype="bf16")
    _run(opt, params, grads[:2])
    saved = _saved(opt)
    assert all(e["momentum_buffer"].dtype == torch.bfloat16 for e in saved["state"].values())
    assert all(g["momentum_dtype"] == "bf16" for g in saved["param_groups"])
    again = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = _optimizer(again, rule=rule, momentum_dtype="bf16")
    resumed.load_state_dict(saved)
    _run(opt, params, grads[2:])
    _run(resumed, again, grads[2:])
    for p, q in zip(params, again, strict=True):
        assert torch.equal(p, q)
        mine, theirs = opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"]
        assert theirs.dtype == torch.bfloat16 and torch.equal(mine, theirs)
    buffers = {resumed.state[q]["momentum_buffer"].untyped_storage().data_ptr() for q in again}
    assert len(buffers) == 1, "loaded momenta are copied into the group's one flat buffer"


@pytest.mark.parametrize(("saved_as", "loaded_as"), [(None, "bf16"), ("bf16", None)])
def test_a_checkpoint_of_another_momentum_dtype_loads_cast_with_a_warning(
    saved_as: str | None, loaded_as: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """An fp32 checkpoint into a bf16-momentum optimizer: each momentum rounded once to
    bf16, one warning per group naming both values, and the run goes on as one that had
    stored bf16 momenta all along (a bf16 checkpoint into the default widens exactly)."""
    starts, grads = _data(3)
    params = [nn.Parameter(s.clone()) for s in starts]
    opt = _optimizer(params, momentum_dtype=saved_as)
    _run(opt, params, grads[:2])
    saved = _saved(opt)
    loaded = _optimizer(
        [nn.Parameter(p.detach().clone()) for p in params], momentum_dtype=loaded_as
    )
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        loaded.load_state_dict(copy.deepcopy(saved))
    assert (
        f"param group 0 was saved with momentum_dtype={saved_as!r} and is loaded as this "
        f"optimizer's momentum_dtype={loaded_as!r}: its momenta carry over, cast to the new "
        "dtype" in caplog.text
    )
    assert loaded.param_groups[0]["momentum_dtype"] == loaded_as
    dtype = torch.bfloat16 if loaded_as == "bf16" else torch.float32
    by_name = dict(
        zip(saved["param_groups"][0]["param_names"], saved["state"].values(), strict=True)
    )
    for name, q in zip(
        loaded.param_groups[0]["param_names"], loaded.param_groups[0]["params"], strict=True
    ):
        momentum = loaded.state[q]["momentum_buffer"]
        assert momentum.dtype == dtype
        assert torch.equal(momentum, by_name[name]["momentum_buffer"].to(dtype))
    assert loaded.state_dict()["param_groups"][0]["momentum_dtype"] == loaded_as


def test_a_momentum_dtype_edit_is_refused_and_nothing_changes() -> None:
    """A layout option: set on a group after the state exists, the next step refuses it by
    name, naming the fix (a new optimizer loaded with this state), weights and momenta as
    they were."""
    starts, grads = _data(4)
    params = [nn.Parameter(s.clone()) for s in starts]
    opt = _optimizer(params)
    _run(opt, params, grads[:1])
    before = [(p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in params]
    opt.param_groups[0]["momentum_dtype"] = "bf16"
    with pytest.raises(
        ValueError,
        match=r"param group 0 momentum_dtype changed from None to 'bf16' since the optimizer "
        r"was built; .*build a new muon_dist.Muon with momentum_dtype='bf16' and load this "
        r"one's state into it .*the momenta carry over, cast to the new dtype",
    ):
        _run(opt, params, grads[1:2])
    for p, (weight, momentum) in zip(params, before, strict=True):
        assert torch.equal(p, weight) and torch.equal(opt.state[p]["momentum_buffer"], momentum)
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32


def test_a_parameter_cast_keeps_its_bf16_momentum() -> None:
    """``module.to(torch.float64)`` rebuilds the step and leaves a bf16 momentum bf16: the
    next step advances it in float64 and rounds it once to bf16."""
    model = nn.Linear(12, 16, bias=False)
    opt = muon_dist.Muon(model.named_parameters(), momentum_dtype="bf16", **FP32)
    model.weight.grad = torch.randn(16, 12)
    opt.step()
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    model.to(torch.float64)
    grad = torch.randn(16, 12, dtype=torch.float64)
    model.weight.grad = grad.clone()
    opt.step()
    stored = opt.state[model.weight]["momentum_buffer"]
    want = torch.add(grad, momentum.double(), alpha=0.95).bfloat16()
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, want)
