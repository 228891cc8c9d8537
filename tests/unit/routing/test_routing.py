"""param_groups: what goes to Muon and what to AdamW, and the routing table."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn

import muon_dist
from muon_dist.routing.names import normalize_fqn


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 8, 6))
        self.fused = nn.Parameter(torch.randn(4 * 3, 6))


class Tiny(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(20, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.experts = Experts()
        self.output = nn.Linear(6, 20, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


@pytest.mark.parametrize("tie", [False, True])
def test_param_groups_route_by_role(tie: bool) -> None:
    groups = muon_dist.param_groups(Tiny(tie), num_experts=4, weight_decay=0.1)
    where = {
        n: (g["algorithm"], g.get("experts"), g.get("num_experts"))
        for g in groups
        for n in g["param_names"]
    }
    assert where["proj.weight"] == ("muon", None, None)
    assert where["experts.w1"][:2] == ("muon", True)
    assert where["experts.fused"] == ("muon", None, 4)
    assert where["tok_embeddings.weight"][0] == "adamw"
    assert ("output.weight" in where) is not tie
    for name in ("proj.bias", "norm.weight", "norm.bias"):
        assert where[name][0] == "adamw"
    decay = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert decay["tok_embeddings.weight"] == 0.1 and decay["norm.weight"] == 0.0


def test_fused_experts_without_num_experts_are_plain_matrices() -> None:
    groups = muon_dist.param_groups(Tiny(False))
    names = [
        n
        for g in groups
        if g["algorithm"] == "muon" and not g.get("experts")
        for n in g["param_names"]
    ]
    assert "experts.fused" in names


def test_wrapper_names_are_normalised() -> None:
    raw = "module._orig_mod.layers.0._checkpoint_wrapped_module.attn._fsdp_wrapped_module.wq.weight"
    assert normalize_fqn(raw) == "layers.0.attn.wq.weight"


def test_routing_table_logged_and_available(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="muon_dist"):
        groups = muon_dist.param_groups(Tiny(False), num_experts=4)
    assert "experts.w1" in caplog.text and "expert_stack 4x[8x6]" in caplog.text
    table = muon_dist.Muon(groups).routing_table()
    assert "fused_experts 4x[3x6]" in table and "output.weight" in table
    assert table.splitlines()[-1].startswith("total adamw:")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(6, 18)  # q, k, v: 2 heads of 3 rows each
        self.w13 = nn.Linear(6, 16, bias=False)  # gate + up
        self.proj = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)


def _where(groups: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {n: g for g in groups for n in g["param_names"]}  # type: ignore[union-attr]


def test_overrides_move_parameters_between_muon_and_adamw() -> None:
    def route(name: str, p: torch.Tensor) -> str | None:
        return "adamw" if name == "proj.weight" else None

    for overrides in (route, {r"^proj\.": "adamw"}):
        where = _where(muon_dist.param_groups(Block(), overrides=overrides))
        assert where["proj.weight"]["algorithm"] == "adamw"
        assert "weight_decay" not in where["proj.weight"]  # Muon's adamw_weight_decay
        assert where["w13.weight"]["algorithm"] == "muon"
    where = _where(muon_dist.param_groups(Tiny(False), overrides={"tok_embeddings": "muon"}))
    assert where["tok_embeddings.weight"]["algorithm"] == "muon"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"proj": "sgd"},
            r"overrides\['proj'\]='sgd'; choose one of \['muon', 'adamw', 'muon:flat'",
        ),
        (lambda n, p: "lion", "overrides returned 'lion' for wqkv.weight"),
        ({"norm": "muon"}, r"routed norm.weight \(shape \(6,\)\) to 'muon'"),
    ],
)
def test_bad_overrides_raise(overrides: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.param_groups(Block(), overrides=overrides)  # type: ignore[arg-type]


def test_fused_weights_are_declared_not_guessed() -> None:
    groups = muon_dist.param_groups(
        Block(),
        fused={
            r"wqkv\.weight$": {"split_sizes": [6, 6, 6], "num_heads": [2, 2, 2]},
            r"w13\.weight$": {"split_sizes": [8, 8]},
        },
    )
    where = _where(groups)
    assert where["wqkv.weight"]["split_sizes"] == [6, 6, 6]
    assert where["wqkv.weight"]["num_heads"] == [2, 2, 2]
    assert where["w13.weight"]["split_sizes"] == [8, 8] and "num_heads" not in where["w13.weight"]
    assert "split_sizes" not in where["proj.weight"]
    assert where["wqkv.bias"]["algorithm"] == "adamw"
    table = muon_dist.Muon(groups).routing_table()
    assert "wqkv.weight[6:12]" in table and "heads 2x[3x6]" in table
    assert "w13.weight[8:16]" in table and "matrix 8x6" in table


@pytest.mark.parametrize(
    ("fused", "message"),
    [
        ({"wqkv": {"split": [6, 12]}}, r"fused\['wqkv'\] has keys \['split'\]"),
        ({"wo": {"num_heads": 2}}, r"fused patterns \['wo'\] match no Muon matrix"),
        ({"w": {"num_heads": 2}, "proj": {"num_heads": 3}}, "matches several fused patterns"),
        ({"w13": {"split_sizes": [8, 4]}}, r"split_sizes=\[8, 4\]"),
    ],
)
def test_bad_fused_declarations_raise(fused: dict[str, dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.param_groups(Block(), fused=fused)


def test_routing_table_counts_parameters_in_millions() -> None:
    model = nn.Sequential(nn.Linear(1000, 1500), nn.Linear(1500, 10))
    table = muon_dist.Muon(muon_dist.param_groups(model)).routing_table()
    assert "1.50" in table.splitlines()[2]  # 0.weight: 1.5M parameters, two decimals
    assert table.splitlines()[-1] == "total adamw: 0.00M, muon: 1.51M"


# ---------------------------------------------------------------------------------------
# torchtitan's parameter names (torchtitan 0.3.0; built by hand, torchtitan is not a test
# dependency) and this project's example model.


class TitanFusedQKV(nn.Module):
    """The attributes and child of torchtitan's FusedQKVLinear: per key-value head, the
    rows of ``heads_per_kv`` query heads, then a key head, then a value head."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.heads_per_kv = heads // kv_heads
        self.wqkv = nn.Linear(dim, kv_heads * (self.heads_per_kv + 2) * head_dim, bias=False)


class TitanExperts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int, gpt_oss: bool) -> None:
        super().__init__()
        if gpt_oss:  # gate and up alternate along G = 2F
            self.mlp1_weight_EGD = nn.Parameter(torch.randn(experts, 2 * hidden, dim))
            self.mlp1_bias_EG = nn.Parameter(torch.zeros(experts, 2 * hidden))
            self.mlp2_weight_EDF = nn.Parameter(torch.randn(experts, dim, hidden))
            self.mlp2_bias_ED = nn.Parameter(torch.zeros(experts, dim))
        else:
            self.w1_EFD = nn.Parameter(torch.randn(experts, hidden, dim))
            self.w2_EDF = nn.Parameter(torch.randn(experts, dim, hidden))
            self.w3_EFD = nn.Parameter(torch.randn(experts, hidden, dim))


class TitanBlock(nn.Module):
    def __init__(self, gpt_oss: bool) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.qkv_linear = TitanFusedQKV(16, heads=4, kv_heads=2, head_dim=4)
        self.attention.wo = nn.Linear(16, 16, bias=False)
        self.attention_norm = nn.RMSNorm(16)
        self.ffn_norm = nn.RMSNorm(16)
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.gate = nn.Linear(16, 4, bias=gpt_oss)
        self.moe.routed_experts = nn.Module()
        self.moe.routed_experts.inner_experts = TitanExperts(4, 16, 24, gpt_oss)
        if not gpt_oss:
            self.moe.shared_experts = nn.Module()
            for name, shape in (("w1", (24, 16)), ("w2", (16, 24)), ("w3", (24, 16))):
                setattr(self.moe.shared_experts, name, nn.Linear(shape[1], shape[0], bias=False))


class TitanModel(nn.Module):
    def __init__(self, gpt_oss: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({"0": TitanBlock(gpt_oss)})
        self.norm = nn.RMSNorm(16)
        self.lm_head = nn.Linear(16, 32, bias=False)


TITAN_EXPECTED = {
    "layers.0.attention.qkv_linear.wqkv.weight": "matrix 32x16 parts 8+4+4 x2 interleaved",
    "layers.0.attention.wo.weight": "matrix 16x16",
    "layers.0.moe.router.gate.weight": "matrix 4x16",
    "tok_embeddings.weight": "adamw",
    "lm_head.weight": "adamw",
    "norm.weight": "adamw",
    "layers.0.attention_norm.weight": "adamw",
    "layers.0.ffn_norm.weight": "adamw",
}
TITAN_MOE = {
    "layers.0.moe.routed_experts.inner_experts.w1_EFD": "expert_stack 4x[24x16]",
    "layers.0.moe.routed_experts.inner_experts.w2_EDF": "expert_stack 4x[16x24]",
    "layers.0.moe.routed_experts.inner_experts.w3_EFD": "expert_stack 4x[24x16]",
    "layers.0.moe.shared_experts.w1.weight": "matrix 24x16",
    "layers.0.moe.shared_experts.w2.weight": "matrix 16x24",
    "layers.0.moe.shared_experts.w3.weight": "matrix 24x16",
}
TITAN_GPT_OSS = {
    "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD": (
        "expert_stack 4x[48x16] parts 1+1 x24 interleaved"
    ),
    "layers.0.moe.routed_experts.inner_experts.mlp1_bias_EG": "adamw",
    "layers.0.moe.routed_experts.inner_experts.mlp2_weight_EDF": "expert_stack 4x[16x24]",
    "layers.0.moe.routed_experts.inner_experts.mlp2_bias_ED": "adamw",
    "layers.0.moe.router.gate.bias": "adamw",
}
# How torchtitan's forward reads them (FusedQKVLinear.forward, gpt_oss/moe.py).
TITAN_TRUE_LAYOUT = {
    "wqkv.weight": {"split_sizes": [8, 4, 4], "split_groups": 2},
    "mlp1_weight_EGD": {"split_sizes": [1, 1], "split_groups": 24},
}


def _views(groups: list[dict[str, object]]) -> dict[str, str]:
    return {
        e.name: e.view if e.algorithm == "muon" else "adamw"
        for e in muon_dist.routing.table.routing_entries(groups)
    }


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_torchtitan_names_route_and_orthogonalize_per_part(
    gpt_oss: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from model_families import check_first_update

    torch.manual_seed(0)
    model = TitanModel(gpt_oss)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        groups = muon_dist.param_groups(model, num_experts=4, observe=False)  # no forward
    assert caplog.text == ""
    assert _views(groups) == {**TITAN_EXPECTED, **(TITAN_GPT_OSS if gpt_oss else TITAN_MOE)}
    fp32 = torch.float32
    opt = muon_dist.Muon(groups, lr=0.02, comm_dtype=fp32, ns_dtype=fp32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    problems = []
    for name, group, p in muon_dist.plan.views.named_params(opt.param_groups):
        if group["algorithm"] == "muon":
            layout = next((v for k, v in TITAN_TRUE_LAYOUT.items() if name.endswith(k)), {})
            problems += check_first_update(name, before[name], p, grads[name], layout, 0.02)
    assert problems == []


def test_example_model_routes_without_warnings(caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util

    from repo_paths import ROOT

    spec = importlib.util.spec_from_file_location("example_model", ROOT / "examples/model.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules["example_model"] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    args = example.ModelArgs(dim=32, n_layers=1, moe=True, tie_embeddings=False)
    model = example.Transformer(args)
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        views = _views(muon_dist.param_groups(model))
    assert caplog.text == ""
    assert views["layers.0.feed_forward.experts.w1"].startswith("expert_stack 4x[")
    assert views["layers.0.feed_forward.router.weight"] == "matrix 4x32"
    assert views["layers.0.attention.wq.weight"] == "matrix 32x32"
    assert views["tok_embeddings.weight"] == views["output.weight"] == "adamw"


class MoE(nn.Module):
    """transformers-style experts: fused gate+up [E, 2I, H] with biases [E, 2I], a down
    projection stored [E, in, out], and a dense shared expert."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 2 * 6, 8))
        self.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 2 * 6))
        self.experts.down_proj = nn.Parameter(torch.randn(4, 6, 12))  # [E, in=6, out=12]
        self.shared_experts = nn.Module()
        self.shared_experts.up_proj = nn.Linear(8, 8, bias=False)


def test_declared_layouts_split_expert_stacks_and_read_storage_orientation() -> None:
    groups = muon_dist.param_groups(
        MoE(),
        num_experts=4,
        fused={
            r"experts\.gate_up_proj$": {"split_sizes": [6, 6]},
            r"experts\.down_proj$": {"transposed": True},
        },
    )
    rows = {e.name: e for e in muon_dist.routing.table.routing_entries(groups)}
    assert rows["experts.gate_up_proj"].view == "expert_stack 4x[12x8] parts 6+6"
    assert rows["experts.gate_up_proj_bias"].algorithm == "adamw"
    # [E, in, out] = [4, 6, 12]: 12 outputs from 6 inputs, the same scale as [4, 12, 6]
    assert rows["experts.down_proj"].lr_scales == (pytest.approx(2**0.5),)
    assert rows["shared_experts.up_proj.weight"].view == "matrix 8x8"  # not cut into experts


def test_param_groups_writes_only_what_it_is_given() -> None:
    opt = muon_dist.Muon(
        muon_dist.param_groups(Tiny(False)), lr=0.05, adamw_lr=1e-3, weight_decay=0.0
    )
    for group in opt.param_groups:
        expected = 0.05 if group["algorithm"] == "muon" else 1e-3
        assert group["lr"] == expected and group["weight_decay"] == 0.0, group["param_names"]
    opt = muon_dist.Muon(muon_dist.param_groups(Tiny(False), lr=0.01, weight_decay=0.2), lr=0.05)
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decay["proj.weight"] == decay["tok_embeddings.weight"] == 0.2
    assert decay["norm.weight"] == 0.0
    assert {g["lr"] for g in opt.param_groups if g["algorithm"] == "muon"} == {0.01}


def test_overrides_pattern_matching_nothing_raises() -> None:
    with pytest.raises(ValueError, match=r"overrides patterns \['\^router\\\\.'\] match no"):
        muon_dist.param_groups(Block(), overrides={r"^router\.": "adamw"})


def test_numbered_expert_modules_are_matrices_of_their_own() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].experts = nn.ModuleList(nn.Linear(8, 6, bias=False) for _ in range(4))
    views = _views(muon_dist.param_groups(model, num_experts=4))
    assert views["layers.0.experts.3.weight"] == "matrix 6x8"


# ---------------------------------------------------------------------------------------
# Structure: convolutions, state-space parameters, small matrices, unknown tensors, audit


class Mixer(nn.Module):
    """A state-space mixer's parameters beside a patch convolution and a depthwise one."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, kernel_size=4)  # [16, 3, 4, 4]
        self.depthwise = nn.Conv1d(16, 16, kernel_size=4, groups=16)  # [16, 1, 4]
        self.A_log = nn.Parameter(torch.zeros(16, 8))
        self.D = nn.Parameter(torch.ones(16))
        self.gate = nn.Linear(16, 1, bias=False)  # one output
        self.proj = nn.Linear(16, 16, bias=False)
        self.attn = nn.MultiheadAttention(16, 2, bias=False)
        self.blob = nn.Parameter(torch.randn(4, 4, 4))  # neither a conv nor an expert stack


def _audit(capsys: pytest.CaptureFixture[str], model: nn.Module, **kwargs: object) -> str:
    """The audit param_groups(report=True) prints."""
    muon_dist.param_groups(model, report=True, **kwargs)  # type: ignore[arg-type]
    return capsys.readouterr().out


def _row(audit: str, name: str) -> str:
    return next(line for line in audit.splitlines() if line.startswith(name + " "))


def test_structure_sends_non_matrices_to_adamw_and_says_why(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        audit = _audit(capsys, Mixer())
    assert "reason" in audit.splitlines()[0]
    for name, reason in [
        ("patch.weight", "Conv2d (conv='adamw')"),
        ("depthwise.weight", "Conv1d (conv='adamw')"),
        ("A_log", "state-space parameter (A_log)"),
        ("D", "state-space parameter (D)"),
        ("gate.weight", "small matrix 1x16 (side < min_matrix_side=4)"),
        ("blob", "unknown 3-D tensor"),
    ]:
        row = _row(audit, name)
        assert " adamw " in row and row.endswith(reason), row
    assert _row(audit, "proj.weight").endswith("Linear [out, in]")
    attn = _row(audit, "attn.in_proj_weight[0:16]")
    assert "matrix 16x16" in attn and attn.endswith("nn.MultiheadAttention: q, k, v blocks")
    # The one guess, with the option that settles it.
    assert "blob$ (4x4x4) is neither a convolution nor an expert stack" in caplog.text
    assert "Pass example_inputs= that reach it" in caplog.text


def test_conv_muon_flattens_filters_and_small_matrices_follow_the_threshold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    audit = _audit(capsys, Mixer(), conv="muon", min_matrix_side=1)
    assert "flat 16x48" in _row(audit, "patch.weight")  # [16, 3*4*4]
    assert _row(audit, "depthwise.weight").endswith("Conv1d with groups=16: not one linear map")
    assert "matrix 1x16" in _row(audit, "gate.weight")
    audit = _audit(capsys, Mixer(), conv="muon", min_matrix_side=17)
    assert _row(audit, "patch.weight").endswith("small matrix 16x48 (side < min_matrix_side=17)")
    audit = _audit(capsys, Mixer(), muon_mode="flat")
    assert "flat 4x16" in _row(audit, "blob")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"conv": "sgd"}, r"conv='sgd'; choose 'adamw'"),
        ({"min_matrix_side": 0}, r"min_matrix_side=0; pass a positive int"),
    ],
)
def test_bad_structure_options_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muon_dist.param_groups(Mixer(), **kwargs)  # type: ignore[arg-type]


class Stacks(nn.Module):
    """Expert containers whose shapes do (``known``) and do not (``square``) tell their
    orientation, and fused 2-D experts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.known = nn.Module()
        self.known.experts = nn.Module()
        self.known.experts.w_in = nn.Parameter(torch.randn(4, 8, 24))  # [E, H, 2I]: in, out
        self.known.experts.w_out = nn.Parameter(torch.randn(4, 12, 8))  # [E, I, H]
        self.square = nn.Module()
        self.square.experts = nn.Module()
        self.square.experts.a = nn.Parameter(torch.randn(4, 8, 8))
        self.square.experts.b = nn.Parameter(torch.randn(4, 8, 8))
        self.flat = nn.Module()
        self.flat.experts = nn.Module()
        self.flat.experts.w = nn.Parameter(torch.randn(4 * 6, 8))


def test_expert_container_shapes_only_propose_orientation_and_halves(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """No class describes these containers: each stack is read [E, out, in], whole per
    expert; where the shapes suggest [E, in, out] and gate+up halves, the warning proposes
    the exact fused= that the second call passes, which then routes without a warning."""
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        audit = _audit(capsys, Stacks())
    assert "expert_stack 4x[8x24] " in _row(audit, "known.experts.w_in")
    assert "matrix 24x8" in _row(audit, "flat.experts.w")
    w_in = r"known\.experts\.w_in$"
    proposed = {w_in: {"transposed": True, "split_sizes": [12, 12]}}
    assert f"pass fused={{{w_in!r}: {proposed[w_in]}}}" in caplog.text
    assert r"known\.experts\.w_out$ (4x12x8): its container's shapes suggest" in caplog.text
    assert "square" not in caplog.text  # square: either reading is the same matrix
    assert r"flat\.experts\.w$ (24x8) is a 2-D weight under an expert module" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        audit = _audit(
            capsys,
            Stacks(),
            num_experts=4,
            fused={**proposed, r"known\.experts\.w_out$": {"transposed": True}},
        )
    assert "expert_stack 4x[8x24] in-out parts 12+12" in _row(audit, "known.experts.w_in")
    assert "expert_stack 4x[12x8] in-out" in _row(audit, "known.experts.w_out")
    assert "fused_experts 4x[6x8]" in _row(audit, "flat.experts.w")
    assert caplog.text == ""
    audit = _audit(capsys, Stacks(), muon_mode="flat", fused=proposed)  # stacks stay per expert
    assert "expert_stack 4x[8x24] in-out parts 12+12" in _row(audit, "known.experts.w_in")


def test_without_config_or_embeddings_the_matrices_tell_the_hidden_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stacks [E, F, D], [E, D, F], [E, F, D] read either way unless D is known to be the
    hidden size: here it is the input most matrices read."""
    model = nn.Module()
    model.attn = nn.ModuleDict({n: nn.Linear(16, 16, bias=False) for n in ("wq", "wk", "wo")})
    model.experts = nn.Module()
    for name, shape in (("w1", (4, 24, 16)), ("w2", (4, 16, 24)), ("w3", (4, 24, 16))):
        setattr(model.experts, name, nn.Parameter(torch.randn(shape)))
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        views = _views(muon_dist.param_groups(model, observe=False))  # it has no forward
    assert caplog.text == ""
    assert views["experts.w1"] == "expert_stack 4x[24x16]"
    assert views["experts.w2"] == "expert_stack 4x[16x24]"


def test_routing_arguments_are_declared_once() -> None:
    """param_groups' routing keywords and their defaults are the declarations of
    muon_dist.routing.arguments, and the README's param_groups table lists each."""
    import inspect

    from repo_paths import ROOT

    from muon_dist.routing.arguments import ROUTING_ARGUMENTS

    signature = inspect.signature(muon_dist.param_groups).parameters
    for argument in ROUTING_ARGUMENTS:
        assert signature[argument.key].default == argument.default, argument.key
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### `param_groups` reference", 1)[1].split("####", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert {a.key for a in ROUTING_ARGUMENTS} <= rows
    with pytest.raises(TypeError, match="unknown routing arguments"):
        muon_dist.routing.param_groups.route_model(nn.Linear(4, 4), no_such=1)
