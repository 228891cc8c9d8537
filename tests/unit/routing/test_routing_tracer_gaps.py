"""No silent route (issue 58): small modules that copy each shape the tracer used to miss,
and the warnings that must name what no evidence settles.

- a grouped projection (a ``Linear`` whose weight is applied through ``view``,
  ``transpose`` and ``bmm``, or ``einsum``) is one matrix per group, never a table;
- a projection whose output gets a table or a broadcast term added before it is cut is
  cut like its twin without the addition;
- a model without dummy inputs warns of every matrix that no class settles (a ``fc1``
  whose output its forward chunks), one line per pattern, saying how many parameters
  each line covers;
- a bare 2-D parameter that nothing reaches (a learned query table) is proposed for
  AdamW with the ``overrides=`` to paste, never pinned on Muon.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.routing.param_groups import route_model


class GroupedLinear(nn.Linear):
    """``groups`` block-diagonal maps stored ``[out, in / groups]``: group g's outputs
    are rows ``g * out/groups ...`` of the weight, applied by ``bmm`` (or ``einsum``)."""

    def __init__(self, width: int, out: int, groups: int, einsum: bool) -> None:
        super().__init__(width // groups, out, bias=False)
        self.groups, self.einsum = groups, einsum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        g = self.groups
        xs = x.reshape(b * n, g, width // g).transpose(0, 1)  # [g, bn, in/g]
        w = self.weight.view(g, -1, width // g)  # [g, out/g, in/g]
        if self.einsum:
            y = torch.einsum("gni,goi->gno", xs, w)
        else:
            y = torch.bmm(xs, w.transpose(1, 2))  # [g, bn, out/g]
        return y.transpose(0, 1).reshape(b, n, -1)


class Grouped(nn.Module):
    def __init__(self, einsum: bool) -> None:
        super().__init__()
        self.proj = GroupedLinear(16, 24, groups=4, einsum=einsum)
        self.mix = nn.Parameter(torch.randn(8, 24))  # applied by a plain einsum
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.einsum("bno,ko->bnk", self.proj(x), self.mix))


@pytest.mark.parametrize("einsum", [False, True])
def test_a_grouped_projection_is_one_matrix_per_group_never_a_table(einsum: bool) -> None:
    routes = route_model(Grouped(einsum), example_inputs=torch.randn(2, 3, 16))
    proj = routes["proj.weight"][1]
    assert proj.algorithm == "muon", proj.reason
    assert dict(proj.options) == {"split_sizes": (6, 6, 6, 6)}, proj.reason
    mix = routes["mix"][1]  # x @ mix.T by einsum: one linear map read by its rows
    assert (mix.algorithm, dict(mix.options)) == ("muon", {}), mix.reason


class Added(nn.Module):
    """Three projections cut in halves: ``plain`` as it is, ``tabled`` after a learned
    position table is added, ``broadcast`` after its one-token product is added to every
    position of a term of the sequence's length."""

    def __init__(self) -> None:
        super().__init__()
        self.plain, self.tabled, self.broadcast = (nn.Linear(8, 16) for _ in range(3))
        self.pos = nn.Parameter(torch.randn(5, 16))
        self.heads = nn.ModuleList(nn.Linear(8, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = self.plain(x).chunk(2, dim=-1)
        c, d = (self.tabled(x) + self.pos).chunk(2, dim=-1)
        e, f = (self.broadcast(x[:, :1]) + x.new_ones(1, 5, 16)).chunk(2, dim=-1)
        pairs = ((a, b), (c, d), (e, f))
        return tuple(h(p * q) for h, (p, q) in zip(self.heads, pairs, strict=True))


def test_a_cut_is_followed_through_an_added_table_or_broadcast_term() -> None:
    routes = route_model(Added(), example_inputs=torch.randn(2, 5, 8))
    for name in ("plain", "tabled", "broadcast"):
        route = routes[f"{name}.weight"][1]
        assert dict(route.options) == {"split_sizes": (8, 8)}, (name, route.reason)
    assert routes["pos"][1].algorithm == "adamw"  # the table itself


class Gated(nn.Module):
    """No dummy inputs; ``fc1``'s output is chunked into a value and a gate; ``query`` is
    a learned table of queries, added to the input (not multiplied)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(8, 32)}) for _ in range(3))
        self.fc2 = nn.Linear(16, 8)
        self.query = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.query
        for layer in self.layers:
            value, gate = layer["fc1"](x).chunk(2, dim=-1)
            x = x + self.fc2(value * torch.sigmoid(gate))
        return x


def _warning(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("muon_dist")
    )


def test_unobserved_matrices_warn_one_line_per_pattern(caplog: pytest.LogCaptureFixture) -> None:
    """Without dummy inputs the three chunked ``fc1`` and ``fc2`` are not observed and no
    class settles them: one warning line for the ``fc1`` of every layer (not one per
    layer), one for ``fc2``, each saying how many parameters it covers, each with the
    ``fused=`` that pins the route taken and the inputs that settle it; passing the inputs
    cuts ``fc1`` and silences them."""
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(Gated())
    lines = [line for line in _warning(caplog).splitlines() if line.startswith("- ")]
    fc1 = [line for line in lines if "fc1" in line]
    assert len(fc1) == 1 and fc1[0].endswith("[3 parameters]"), lines
    assert "was not observed (no example_inputs" in fc1[0]
    assert "pass example_inputs= that reach it" in fc1[0]
    assert re.search(r"fused=\{'layers\\\\\.\\\\d\+\\\\\.fc1\\\\\.weight\$'", fc1[0]), fc1[0]
    assert any("fc2" in line and line.endswith("[1 parameter]") for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        groups = muon_dist.param_groups(Gated(), example_inputs=torch.randn(2, 4, 8))
    assert _warning(caplog) == ""
    split = {n: g.get("split_sizes") for g in groups for n in g["param_names"]}
    assert split["layers.0.fc1.weight"] == [16, 16]


def test_an_unreached_bare_table_is_proposed_for_adamw(caplog: pytest.LogCaptureFixture) -> None:
    """``query`` is no linear module's weight: unobserved, its warning proposes AdamW with
    the exact ``overrides=`` to paste, and never offers to pin it on Muon."""
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.param_groups(Gated())
    (line,) = [line for line in _warning(caplog).splitlines() if "query" in line]
    assert "until you pass overrides={'query$': 'adamw'}" in line
    assert "fused=" not in line and "split_sizes" not in line
    groups = muon_dist.param_groups(Gated(), overrides={"query$": "adamw"})
    algorithm = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert algorithm["query"] == "adamw"


class ReadsValue(nn.Module):
    """A forward that reads a value (``.item()``, which meta tensors do not have), with a
    batch norm and dropout that a real forward in training mode would update and draw."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.drop, self.head = nn.Dropout(0.5), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        if h.abs().max().item() > 1e9:
            raise ValueError("overflow")
        a, b = self.drop(h).chunk(2, dim=-1)
        return self.head(a * b)


def test_a_forward_that_reads_a_value_is_observed_on_the_models_own_tensors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On meta it cannot run; on the model's own tensors it can, and it leaves the model's
    buffers and the caller's random numbers as they were."""
    model, x = ReadsValue(), torch.randn(4, 8)
    before = model.norm.running_mean.clone()
    state = torch.random.get_rng_state()
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        routes = route_model(model, example_inputs=x)
    assert "observed the forward on its own tensors on example_inputs" in caplog.text
    assert dict(routes["proj.weight"][1].options) == {"split_sizes": (8, 8)}
    assert torch.equal(model.norm.running_mean, before) and model.training
    assert torch.equal(torch.random.get_rng_state(), state)
