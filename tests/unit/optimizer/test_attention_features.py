"""Single-process checks of per-head and split views, Magma, cautious decay and QK-clip."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference_muon import reference_muon_step, step_with_grads
from torch import nn

import muon_dist

# Exact comparisons run Newton–Schulz in fp32: bf16 products round with the batch shape.
FP32 = {"comm_dtype": torch.float32, "ns_dtype": torch.float32}


@pytest.mark.parametrize(
    "options", [{}, {"magma": True, "cautious_wd": True, "weight_decay": 0.1}], ids=str
)
def test_heads_and_split_blocks_equal_separate_parameters(options: dict[str, object]) -> None:
    torch.manual_seed(0)
    hd, cols = 10, 6  # head_dim > cols: the spectral lr scale differs per block
    blocks = {
        "qkv": ([3 * hd, hd, hd], [3, 1, 1]),
        "wq": ([3 * hd], [3]),
        "gate_up": ([14, 9], [1, 1]),
    }
    fulls = {k: torch.randn(sum(sizes), cols) for k, (sizes, _) in blocks.items()}
    fused = {k: nn.Parameter(f.clone()) for k, f in fulls.items()}
    opt_fused = muon_dist.Muon(
        [
            {"params": [fused["qkv"]], "split_sizes": [3 * hd, hd, hd], "num_heads": [3, 1, 1]},
            {"params": [fused["wq"]], "num_heads": 3},
            {"params": [fused["gate_up"]], "split_sizes": [14, 9]},
        ],
        lr=0.05,
        **FP32,
        **options,
    )
    separate: dict[str, list[nn.Parameter]] = {}
    for key, (sizes, heads) in blocks.items():
        rows = [n // h for n, h in zip(sizes, heads, strict=True) for _ in range(h)]
        separate[key] = [nn.Parameter(t.clone()) for t in fulls[key].split(rows)]
    flat = [p for ps in separate.values() for p in ps]
    opt_sep = muon_dist.Muon([{"params": flat}], lr=0.05, **FP32, **options)
    for _ in range(3):
        grads = {k: torch.randn_like(f) for k, f in fulls.items()}
        step_with_grads(opt_fused, list(fused.values()), list(grads.values()))
        sep_grads = [
            g for k, ps in separate.items() for g in grads[k].split([p.shape[0] for p in ps])
        ]
        step_with_grads(opt_sep, flat, sep_grads)
    for key, ps in separate.items():
        expected = torch.cat([p.detach() for p in ps])
        torch.testing.assert_close(fused[key].detach(), expected, rtol=0, atol=1e-6)


def test_magma_and_cautious_wd_match_reference() -> None:
    torch.manual_seed(1)
    shapes = {"matrix": (24, 16), "experts": (3, 10, 12), "fused": (4 * 6, 9)}
    matrices = {"matrix": None, "experts": (3, 10, 12), "fused": (4, 6, 9)}
    fulls = {k: torch.randn(s) for k, s in shapes.items()}
    params = {k: nn.Parameter(f.clone()) for k, f in fulls.items()}
    opt = muon_dist.Muon(
        [
            {"params": [params["matrix"]]},
            {"params": [params["experts"]], "experts": True},
            {"params": [params["fused"]], "num_experts": 4},
        ],
        lr=0.03,
        weight_decay=0.2,
        magma=True,
        magma_beta=0.8,
        cautious_wd=True,
        **FP32,
    )
    refs = {k: f.clone() for k, f in fulls.items()}
    moms = {k: torch.zeros_like(f) for k, f in fulls.items()}
    scores = {k: torch.ones(1 if m is None else m[0]) for k, m in matrices.items()}
    base = {k: torch.randn(s) for k, s in shapes.items()}
    for t in range(5):
        # A shared direction whose sign flips every third step: cosines of both signs.
        grads = {k: b * (-1 if t % 3 == 2 else 1) + torch.randn_like(b) for k, b in base.items()}
        step_with_grads(opt, list(params.values()), list(grads.values()))
        for k in shapes:
            reference_muon_step(
                refs[k],
                grads[k],
                moms[k],
                lr=0.03,
                weight_decay=0.2,
                matrices=matrices[k],
                magma_score=scores[k],
                magma_beta=0.8,
                cautious_wd=True,
                ns_dtype=torch.float32,
            )
    for k in shapes:
        torch.testing.assert_close(params[k].detach(), refs[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[params[k]]["magma_score"], scores[k])
    assert min(s.min().item() for s in scores.values()) < 0.9  # damping did something


def test_magma_damps_updates_down_to_the_floor() -> None:
    """A gradient against the momentum drives the score to 0 and the update to 0.1x Muon's."""
    torch.manual_seed(2)
    full, direction = torch.randn(12, 8), torch.randn(12, 8)
    damped, plain = nn.Parameter(full.clone()), nn.Parameter(full.clone())
    opt_damped = muon_dist.Muon([damped], weight_decay=0.0, magma=True, magma_beta=0.5)
    opt_plain = muon_dist.Muon([plain], weight_decay=0.0)
    for t in range(12):
        grad = direction * (100.0 if t == 0 else -1.0)  # momentum stays along +direction
        before = (damped.detach().clone(), plain.detach().clone())
        step_with_grads(opt_damped, [damped], [grad])
        step_with_grads(opt_plain, [plain], [grad])
        damping = 0.1 + 0.9 * opt_damped.state[damped]["magma_score"]
        # With no decay the update does not depend on the weights: only the damping differs.
        torch.testing.assert_close(
            damped.detach() - before[0], damping * (plain.detach() - before[1]), rtol=0, atol=1e-6
        )
    assert opt_damped.state[damped]["magma_score"].item() < 1e-3


def _model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 6))


def test_magma_scores_stay_fp32_for_bf16_parameters() -> None:
    p = nn.Parameter(torch.randn(6, 5).bfloat16())
    opt = muon_dist.Muon([p], magma=True)
    for _ in range(2):
        step_with_grads(opt, [p], [torch.randn(6, 5).bfloat16()])
    score = opt.state[p]["magma_score"]
    other = muon_dist.Muon([p], magma=True)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.state[p]["magma_score"].dtype == torch.float32
    assert torch.equal(other.state[p]["magma_score"], score)


def test_state_saved_without_magma_loads_into_magma_with_its_momenta(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A state saved with ``magma=False`` loads into ``magma=True`` (README, Reliability): the
    momenta carry over and the scores start as a new optimizer's, with a warning."""
    model = _model()
    opt = muon_dist.Muon(model.named_parameters())
    weights = [p for p in model.parameters() if p.ndim == 2]
    step_with_grads(opt, weights, [torch.randn_like(p) for p in weights])
    saved = copy.deepcopy(opt.state_dict())
    fresh = muon_dist.Muon(model.named_parameters(), magma=True)
    fresh.load_state_dict(saved)
    assert "saved with magma=False and is loaded as" in caplog.text
    for p in weights:
        assert torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
        score = fresh.state[p]["magma_score"]
        assert score.dtype == torch.float32 and torch.equal(score, torch.ones_like(score))


class _Attention(nn.Module):
    """Just enough attention to produce logits: [batch, heads, seq, seq]."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.probe = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        return self.probe(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim))


def _per_head_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().amax(dim=(0, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_qk_clip_brings_an_exploding_head_back_under_tau(kv_heads: int) -> None:
    torch.manual_seed(5)
    attn = _Attention(heads=4, kv_heads=kv_heads)
    with torch.no_grad():
        attn.wq.weight[4:8] *= 100.0  # query head 1 explodes
        attn.wk.weight.mul_(3.0)
    x = torch.randn(2, 6, 16)
    tracker = muon_dist.MaxLogitTracker()
    handle = tracker.attach(attn.probe, "attn")
    tau = 10.0
    opt = muon_dist.Muon(
        attn.named_parameters(),
        lr=0.0,  # isolate the clip: the Muon update is zero
        qk_clip=[
            muon_dist.QKClip("attn", "wq.weight", "wk.weight", 4, num_kv_heads=kv_heads, tau=tau)
        ],
        max_logits=tracker,
    )
    before = _per_head_max(attn(x))
    assert before[1] > 10 * tau and before.min() < tau
    wk_before = attn.wk.weight.detach().clone()
    attn(x).sum().backward()
    opt.step()
    handle.remove()
    after = _per_head_max(attn(x))
    assert after.max() <= tau * (1 + 1e-5)
    torch.testing.assert_close(after[1], torch.tensor(tau))
    for h in range(4):
        if before[h] <= tau:  # heads within bounds keep their logits
            torch.testing.assert_close(after[h], before[h])
    if kv_heads < 4:  # grouped-query: shared keys are left alone
        assert torch.equal(attn.wk.weight.detach(), wk_before)


def test_max_logit_tracker_keeps_a_running_max_until_popped() -> None:
    tracker = muon_dist.MaxLogitTracker()
    tracker.record("a", torch.tensor([[[[1.0, 5.0]], [[2.0, -1.0]]]]))  # [1, 2, 1, 2]
    tracker.record("a", torch.tensor([[[[3.0]], [[float("-inf")]]]]))
    assert torch.equal(tracker.pop()["a"], torch.tensor([5.0, 2.0]))
    assert tracker.pop() == {}
    with pytest.raises(ValueError, match="expected"):
        tracker.record("a", torch.zeros(2, 3))


def test_recorded_layer_without_qk_clip_raises_at_step() -> None:
    attn = _Attention(heads=2, kv_heads=2)
    tracker = muon_dist.MaxLogitTracker()
    opt = muon_dist.Muon(
        attn.named_parameters(),
        qk_clip=[muon_dist.QKClip("attn", "wq.weight", "wk.weight", 2)],
        max_logits=tracker,
    )
    tracker.record("atn", torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match=r"recorded layers \['atn'\] that no QKClip names"):
        opt.step()


@pytest.mark.parametrize(
    ("clip", "tracker", "error", "message"),
    [
        (dict(query="wv.weight"), True, ValueError, "query='wv.weight' is not a parameter"),
        (dict(num_heads=3), True, ValueError, r"not divisible into 3 heads \(num_heads\)"),
        (dict(num_kv_heads=3), True, ValueError, "num_kv_heads"),
        (dict(key_rows=(0, 4)), True, ValueError, "query head_dim 4 != key head_dim 2"),
        (dict(query_rows=(4, 20)), True, ValueError, r"query_rows=\(4, 20\)"),
        (dict(tau=0.0), True, ValueError, "tau=0.0"),
        ({}, False, TypeError, "max_logits=muon_dist.MaxLogitTracker"),
    ],
)
def test_bad_qk_clip_raises(
    clip: dict[str, object], tracker: bool, error: type[Exception], message: str
) -> None:
    attn = _Attention(heads=2, kv_heads=2)
    spec = {"layer": "attn", "query": "wq.weight", "key": "wk.weight", "num_heads": 2, **clip}
    with pytest.raises(error, match=message):
        muon_dist.Muon(
            attn.named_parameters(),
            qk_clip=[muon_dist.QKClip(**spec)],  # type: ignore[arg-type]
            max_logits=muon_dist.MaxLogitTracker() if tracker else None,
        )


def test_max_logits_without_qk_clip_raises() -> None:
    with pytest.raises(ValueError, match="max_logits is only read by qk_clip"):
        muon_dist.Muon([nn.Parameter(torch.randn(4, 4))], max_logits=muon_dist.MaxLogitTracker())


@pytest.mark.parametrize(
    ("shape", "group", "message"),
    [
        ((10, 4), {"split_sizes": [4, 4]}, r"10 rows but its group sets split_sizes=\[4, 4\]"),
        ((10, 4), {"num_heads": 3}, "num_heads=3"),
        ((10, 4), {"num_heads": [5, 5]}, r"num_heads=\[5, 5\]"),
        ((10, 4), {"split_sizes": [6, 4], "num_heads": 2}, "not num_heads=2"),
        ((10, 4), {"split_sizes": [6, 4], "num_heads": [4, 1]}, r"num_heads\[0\]=4"),
        ((10, 4), {"num_heads": 2, "num_experts": 2}, "set only one of them"),
        ((2, 4, 4), {"experts": True, "split_sizes": [1, 2]}, "the parts must add up"),
        ((2, 4, 4), {"experts": True, "split_sizes": [2, 2], "num_heads": 2}, "drop num_heads"),
        ((4, 6), {"split_sizes": [1, 1], "split_groups": 3}, r"4 outputs.*\(6\)"),
        ((4, 6), {"split_groups": 2}, "split_sizes, which is not set"),
        ((4, 6), {"num_heads": 2, "transposed": True}, "stores outputs as columns"),
        ((10, 4), {"magma": 1}, "magma=1; choose True or False"),
        ((10, 4), {"cautious_wd": "yes"}, "cautious_wd='yes'"),
        ((10, 4), {"magma_beta": 1.0}, "magma_beta=1.0"),
        ((10,), {"algorithm": "adamw", "magma": True}, "magma=True is a Muon option"),
        ((10,), {"algorithm": "adamw", "cautious_wd": True}, "cautious_wd=True is a Muon"),
        ((10, 4), {"algorithm": "adamw", "num_heads": 2}, "num_heads=2 is a Muon option"),
    ],
)
def test_bad_feature_options_raise(
    shape: tuple[int, ...], group: dict[str, object], message: str
) -> None:
    p = nn.Parameter(torch.randn(shape))
    with pytest.raises((ValueError, TypeError), match=message):
        muon_dist.Muon(
            [{"params": [p], "param_names": ["blocks.0.w"], "algorithm": "muon", **group}]
        )


def test_routing_table_shows_heads_and_row_blocks() -> None:
    p = nn.Parameter(torch.randn(24, 8))
    table = muon_dist.Muon(
        [
            {
                "params": [p],
                "param_names": ["attn.wqkv"],
                "split_sizes": [16, 4, 4],
                "num_heads": [4, 1, 1],
            }
        ]
    ).routing_table()
    assert "attn.wqkv[0:16]" in table and "heads 4x[4x8]" in table
    assert "attn.wqkv[20:24]" in table and "matrix 4x8" in table
