"""Bad options, parameters and saved states raise before anything changes (issue 17)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import muon_dist

NAN, INF = float("nan"), float("inf")


def _params() -> tuple[nn.Parameter, nn.Parameter]:
    torch.manual_seed(0)
    return nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": NAN}, r"lr=nan is not finite"),
        ({"lr": INF}, r"lr=inf is not finite"),
        ({"weight_decay": NAN}, r"weight_decay=nan is not finite"),
        ({"momentum": NAN}, r"momentum=nan is not finite"),
        ({"adamw_eps": NAN}, r"eps=nan is not finite"),
        ({"adamw_lr": INF}, r"lr=inf is not finite"),
        ({"adamw_betas": (0.9, NAN)}, r"betas\[1\]=nan is not finite"),
        ({"magma_beta": NAN}, r"magma_beta=nan is not finite"),
        ({"coefficients": [(3.4, NAN, 2.0)]}, r"coefficients\[0\]=nan is not finite"),
        ({"momentum": 1.5}, r"momentum=1\.5 is out of range"),
    ],
)
def test_nonfinite_or_out_of_range_options_raise(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        muon_dist.Muon(list(_params()), **kwargs)


@pytest.mark.parametrize("value", ["fp16", "BF16", "float32", torch.bfloat16, 16, True])
@pytest.mark.parametrize("where", ["argument", "group"])
def test_a_bad_momentum_dtype_is_refused_naming_the_value_and_the_choices(
    value: Any, where: str
) -> None:
    """ValueError at construction, before any state exists, naming the option, the value,
    the values it takes and (for a torch dtype) the name to pass instead."""
    w, b = _params()
    params: list[Any] = [("w", w), ("b", b)]
    options = {"momentum_dtype": value}
    if where == "group":
        params, options = [{"params": [w], "algorithm": "muon", **options}], {}
    with pytest.raises(ValueError) as refused:
        muon_dist.Muon(params, **options)
    message = str(refused.value)
    assert f"param group 0 (muon): momentum_dtype={value!r} is not supported" in message
    assert "choose one of [None, 'fp32', 'bf16']" in message
    if value is torch.bfloat16:
        assert "(for torch.bfloat16: momentum_dtype='bf16')" in message


def test_momentum_dtype_on_an_adamw_group_is_refused_as_a_muon_option() -> None:
    _, b = _params()
    with pytest.raises(ValueError, match=r"momentum_dtype='bf16' is a Muon option"):
        muon_dist.Muon([{"params": [b], "algorithm": "adamw", "momentum_dtype": "bf16"}])


def test_a_saved_bad_momentum_dtype_is_refused_before_anything_changes() -> None:
    w, _ = _params()
    opt = muon_dist.Muon([("w", w)], momentum_dtype="bf16")
    w.grad = torch.randn_like(w)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["momentum_dtype"] = "fp8"
    before = opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(
        ValueError, match=r"saved param group 0 \(muon\): momentum_dtype='fp8' is not supported"
    ):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["momentum_dtype"] == "bf16"
    assert torch.equal(opt.state[w]["momentum_buffer"], before)


def test_tensor_lr_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"lr is a tensor .*pass a Python float"):
        muon_dist.Muon(list(_params()), adamw_lr=torch.tensor(1e-3))  # type: ignore[arg-type]


def test_misspelled_group_key_is_refused_with_a_suggestion() -> None:
    w, b = _params()
    with pytest.raises(
        ValueError, match=r"unknown group key 'weight_decy'; did you mean 'weight_decay'"
    ):
        muon_dist.Muon([{"params": [w], "algorithm": "muon", "weight_decy": 0.1}])
    # Without an algorithm, each part drops the other algorithm's keys; typos still fail.
    muon_dist.Muon([{"params": [w, b], "momentum": 0.9, "betas": (0.8, 0.9)}])
    with pytest.raises(ValueError, match=r"unknown group key 'momentun'"):
        muon_dist.Muon([{"params": [w, b], "momentun": 0.9}])


def test_duplicate_parameter_in_a_group_is_refused() -> None:
    w, _ = _params()
    with pytest.raises(ValueError, match=r"'group0.param1' is listed twice .*'group0.param0'"):
        muon_dist.Muon([w, w])


@pytest.mark.parametrize(
    ("param", "error", "pattern"),
    [
        (torch.randn(8, 0), ValueError, r"shape \(8, 0\) with an empty dim"),
        (torch.randn(4, 4, dtype=torch.complex64), TypeError, r"dtype torch.complex64"),
    ],
)
def test_bad_parameters_raise_at_construction(
    param: torch.Tensor, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        muon_dist.Muon([nn.Parameter(param)])


def test_sparse_gradient_raises_naming_the_parameter_before_any_change() -> None:
    w, b = _params()
    opt = muon_dist.Muon(
        [
            {"params": [w], "param_names": ["mlp.w"], "algorithm": "muon"},
            {"params": [b], "param_names": ["emb.weight"], "algorithm": "adamw"},
        ]
    )
    before = w.detach().clone()
    w.grad = torch.randn(8, 6)
    b.grad = torch.randn(6).to_sparse()
    with pytest.raises(TypeError, match=r"emb\.weight has a sparse gradient"):
        opt.step()
    assert torch.equal(w.detach(), before)
    assert torch.count_nonzero(opt.state[w]["momentum_buffer"]) == 0


def _two_layers() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))


def test_load_state_dict_maps_state_by_name() -> None:
    model = _two_layers()
    opt = muon_dist.Muon(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    # The same parameters listed in the other order: each keeps its own momentum.
    reordered = list(reversed(list(model.named_parameters())))
    other = muon_dist.Muon(reordered)
    other.load_state_dict(saved)
    for p in model.parameters():
        torch.testing.assert_close(
            other.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"], rtol=0, atol=0
        )


def test_load_state_dict_refuses_changed_muon_mode() -> None:
    conv = nn.Parameter(torch.randn(4, 3, 2, 2))
    opt = muon_dist.Muon([("conv.weight", conv)], muon_mode="flat")
    saved = opt.state_dict()
    other = muon_dist.Muon([("conv.weight", conv)], muon_mode="slice")
    with pytest.raises(ValueError, match=r"conv\.weight: muon_mode='flat' when saved, 'slice' now"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(("key", "value"), [("momentum", 1.5), ("lr", NAN)])
def test_load_state_dict_validates_options(key: str, value: float) -> None:
    model = _two_layers()
    opt = muon_dist.Muon(model.named_parameters())
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][key] = value
    fresh = muon_dist.Muon(model.named_parameters())
    with pytest.raises(ValueError, match=rf"param group 0 \(muon\): {key}="):
        fresh.load_state_dict(saved)
    assert fresh.param_groups[0][key] == opt.param_groups[0][key]


def test_loading_a_torch_adamw_state_names_the_problem() -> None:
    model = _two_layers()
    adamw = torch.optim.AdamW(model.parameters())
    opt = muon_dist.Muon(model.named_parameters())
    with pytest.raises(ValueError, match=r"not saved by muon_dist\.Muon"):
        opt.load_state_dict(adamw.state_dict())


def test_fp16_gradient_with_a_large_norm_is_finite() -> None:
    """Finiteness is judged in fp64: an fp16 norm above 65504 is no overflow of the step."""
    w = nn.Parameter(torch.randn(64, 64, dtype=torch.float16))
    opt = muon_dist.Muon([w], nonfinite="raise")
    w.grad = torch.full((64, 64), 30000.0, dtype=torch.float16)  # norm 1.9e6 > 65504
    before = w.detach().clone()
    opt.step()
    assert torch.isfinite(w.detach()).all() and not torch.equal(w.detach(), before)


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_overflowing_norm_is_reported_as_such_and_changes_nothing(policy: str) -> None:
    w, b = _params()
    opt = muon_dist.Muon(
        [
            {"params": [w], "param_names": ["mlp.w"], "algorithm": "muon"},
            {"params": [b], "param_names": ["norm.b"], "algorithm": "adamw"},
        ],
        nonfinite=policy,
    )
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    w.grad[0, 0] = 1e30
    before = (w.detach().clone(), b.detach().clone())
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"gradient norm too large in mlp\.w"):
            opt.step()
    else:
        opt.step()
        assert opt.param_groups[0]["skipped_steps"] == 1
    assert torch.equal(w.detach(), before[0]) and torch.equal(b.detach(), before[1])
    assert torch.count_nonzero(opt.state[w]["momentum_buffer"]) == 0
    assert float(opt.state[b]["step"]) == 0.0


def test_loaded_momentum_is_the_one_the_step_uses() -> None:
    """Loading replaces the group dicts; the step must read the loaded ones."""
    from reference_muon import reference_muon_step

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6))
    opt = muon_dist.Muon([("w", w)], momentum=0.9, comm_dtype=torch.float32, ns_dtype=torch.float32)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["momentum"] = 0.5
    opt.load_state_dict(saved)
    ref, buf = w.detach().clone(), torch.zeros(8, 6)
    for _ in range(2):
        grad = torch.randn(8, 6)
        w.grad = grad.clone()
        opt.step()
        reference_muon_step(ref, grad, buf, lr=0.02, momentum=0.5, ns_dtype=torch.float32)
    torch.testing.assert_close(w.detach(), ref, rtol=0, atol=1e-6)
