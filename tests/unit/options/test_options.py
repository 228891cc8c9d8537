"""The option schema is the one declaration of every option: the constructor's signature,
the README's options table and checkpoint upgrades all follow it."""

from __future__ import annotations

import inspect
import re

import torch
from repo_paths import ROOT

import muon_dist
from muon_dist.options.schema import ADAMW_OPTIONS, MUON_OPTIONS, OPTIONS, SETTINGS

# Constructor arguments that are not options of a group or a setting.
NOT_OPTIONS = {"self", "params", "qk_clip", "max_logits", "process_group"}


def _arguments() -> dict[str, object]:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(muon_dist.Muon.__init__).parameters.items()
        if name not in NOT_OPTIONS
    }


def test_the_constructor_defaults_are_the_declared_ones() -> None:
    declared = {
        o.argument: o.default
        for o in (*MUON_OPTIONS, *ADAMW_OPTIONS, *SETTINGS)
        if o.argument is not None
    }
    assert _arguments() == declared


def test_the_readme_options_table_lists_every_option() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### Options", 1)[1].split("\n\n", 2)[1]
    listed = set(
        re.findall(r"`(\w+)`", " ".join(line.split("|")[1] for line in table.splitlines()))
    )
    keys = {o.argument or o.key for options in OPTIONS.values() for o in options}
    keys |= {o.key for o in SETTINGS}
    assert keys - listed == set()


def test_groups_take_the_declared_defaults() -> None:
    weight, bias = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(4))
    opt = muon_dist.Muon([weight, bias])
    muon, adamw = (next(g for g in opt.param_groups if g["algorithm"] == a) for a in OPTIONS)
    for option in MUON_OPTIONS:
        assert muon[option.key] == option.default, option.key
    for option in ADAMW_OPTIONS:
        assert adamw[option.key] == option.default, option.key
    for option in SETTINGS:
        assert getattr(opt.settings, option.key) == option.default, option.key


def test_a_checkpoint_from_before_an_option_existed_loads_with_its_default() -> None:
    """Keys a saved group lacks are filled once, at load, with their declared defaults, and
    the run continues exactly as one whose checkpoint had them."""
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(6, 8, generator=gen)
    grads = [torch.randn(6, 8, generator=gen) for _ in range(4)]

    def run(strip: tuple[str, ...]) -> tuple[torch.Tensor, dict[str, object]]:
        weight = torch.nn.Parameter(start.clone())
        opt = muon_dist.Muon([weight], ns_dtype=torch.float32, comm_dtype=torch.float32)
        for grad in grads[:2]:
            weight.grad = grad.clone()
            opt.step()
        saved = opt.state_dict()
        for group in saved["param_groups"]:
            for key in strip:
                group.pop(key, None)
        again = muon_dist.Muon(
            [torch.nn.Parameter(weight.detach().clone())],
            ns_dtype=torch.float32,
            comm_dtype=torch.float32,
        )
        again.load_state_dict(saved)
        (param,) = again.param_groups[0]["params"]
        for grad in grads[2:]:
            param.grad = grad.clone()
            again.step()
        return param.detach(), again.param_groups[0]

    stripped = ("rule", "ns_method", "normuon_beta2", "normuon_eps", "dion2_fraction")
    stripped += ("momentum_dtype",)
    full, _ = run(())
    old, group = run(stripped)
    for key in stripped:
        assert group[key] == next(o.default for o in MUON_OPTIONS if o.key == key)
    torch.testing.assert_close(old, full, rtol=0, atol=0)
