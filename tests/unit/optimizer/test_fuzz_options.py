"""Fuzzed groups: construction refuses bad options by name, or a step matches the reference.

Small and fast on purpose (one process, CPU, a bounded number of examples): hypothesis
draws group options, including out-of-range and non-finite ones, and parameter shapes and
dtypes; either ``Muon(...)`` raises a ``ValueError``/``TypeError`` naming the offending key
or parameter, or one step leaves finite parameters equal to single-device Muon's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_muon import reference_muon_step
from torch import nn

import muon_dist

NUMBERS = st.one_of(
    st.floats(min_value=0.0, max_value=0.99),
    st.sampled_from([-0.1, 1.0, 1.5, math.nan, math.inf]),
)
OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "lr": NUMBERS,
        "momentum": NUMBERS,
        "weight_decay": NUMBERS,
        "nesterov": st.booleans(),
        "adjust_lr": st.sampled_from(["spectral_norm", "rms_norm", None, "bogus"]),
        "ns_steps": st.sampled_from([1, 3, 5, 0]),
        "coefficients": st.sampled_from(["quintic", "keller", "polar_express", "nope"]),
    },
)
ADAMW_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "lr": NUMBERS,
        "weight_decay": NUMBERS,
        "eps": st.sampled_from([1e-8, 0.0, -1.0, math.nan]),
        "betas": st.tuples(NUMBERS, NUMBERS),
    },
)
SHAPES = st.sampled_from([(4, 4), (3, 7), (9, 2), (1, 5), (6, 0), (5,), (2, 3, 4)])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.complex64, torch.int64])


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    options=OPTIONS,
    adamw_options=ADAMW_OPTIONS,
    shape=SHAPES,
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_fuzzed_group_raises_by_name_or_matches_reference(
    options: dict[str, Any],
    adamw_options: dict[str, Any],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=gen).to(dtype)
    p = nn.Parameter(full.clone(), requires_grad=dtype.is_floating_point or dtype.is_complex)
    bias_full = torch.randn(5, generator=gen)
    bias = nn.Parameter(bias_full.clone())
    groups = [
        {"params": [p], "param_names": ["fuzz.w"], "algorithm": "muon", **options},
        {"params": [bias], "param_names": ["fuzz.b"], "algorithm": "adamw", **adamw_options},
    ]
    try:
        # fp32 Newton–Schulz: exact on fp32 parameters whatever the CPU's bf16 kernels do.
        opt = muon_dist.Muon(groups, comm_dtype=torch.float32, ns_dtype=torch.float32)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        keys = [*options, *adamw_options]
        named = [k for k in keys if k in message] + ["fuzz.w", "ns_steps", "coefficients"]
        assert any(n in message for n in named), message
        return
    assert p.ndim == 2 and dtype in (torch.float32, torch.bfloat16) and 0 not in shape
    grad = torch.randn(shape, generator=gen).to(dtype)
    bias_grad = torch.randn(5, generator=gen)
    p.grad, bias.grad = grad.clone(), bias_grad.clone()
    opt.step()
    adamw = opt.param_groups[1]
    ref_bias = nn.Parameter(bias_full.clone())
    ref_bias.grad = bias_grad
    torch.optim.AdamW(
        [ref_bias],
        lr=adamw["lr"],
        betas=adamw["betas"],
        eps=adamw["eps"],
        weight_decay=adamw["weight_decay"],
    ).step()
    assert torch.isfinite(bias.detach()).all()
    torch.testing.assert_close(bias.detach(), ref_bias.detach(), rtol=1e-6, atol=1e-6)
    group = opt.param_groups[0]
    ref = full.clone()
    reference_muon_step(
        ref,
        grad,
        torch.zeros_like(ref),
        lr=group["lr"],
        momentum=group["momentum"],
        nesterov=group["nesterov"],
        weight_decay=group["weight_decay"],
        adjust_lr=group["adjust_lr"],
        ns_steps=group["ns_steps"],
        coefficients=group["coefficients"],
        ns_dtype=torch.float32,
    )
    assert torch.isfinite(p.detach()).all()
    # A bf16 parameter rounds at its decay and its update: about an ulp (2^-7 relative) apart.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(p.detach(), ref, rtol=0, atol=tolerance)
