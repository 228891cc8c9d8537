"""transformers' Trainer builds Muon routed by the model's structure through MuonFactory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from model_families import build

import muon_dist

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


def _trainer(model: object, tmp_path: Path, optimizer: tuple[object, dict[str, object]]) -> object:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    return Trainer(model=model, args=args, optimizer_cls_and_kwargs=optimizer)  # type: ignore[arg-type]


def _algorithms(opt: muon_dist.Muon) -> dict[str, str]:
    return {n: g["algorithm"] for n, g, _ in muon_dist.routing.named_params(opt.param_groups)}


def test_trainer_calls_the_factory_with_the_model() -> None:
    """What Trainer.create_optimizer does with optimizer_cls_and_kwargs (transformers 5.23):
    a class that is not an Optimizer is a factory, called as cls()(model, **kwargs)."""
    from transformers.trainer_optimizer import is_optimizer_factory

    from muon_dist.integrations.hf_trainer import MuonFactory

    assert is_optimizer_factory(MuonFactory) and not is_optimizer_factory(muon_dist.Muon)
    model = build("gpt2")
    opt = MuonFactory()(model, lr=0.01, adamw_lr=1e-3, conv="adamw")
    assert _algorithms(opt) == _algorithms(muon_dist.Muon(muon_dist.param_groups(model)))
    assert {g["lr"] for g in opt.param_groups if g["algorithm"] == "muon"} == {0.01}


def test_trainer_with_factory_routes_like_param_groups(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from muon_dist.integrations.hf_trainer import MuonFactory

    model = build("gpt2")
    options = {"lr": 0.01, "adamw_lr": 1e-3, "conv": "adamw"}
    trainer = _trainer(model, tmp_path, (MuonFactory, options))
    opt = trainer.create_optimizer()  # type: ignore[attr-defined]
    assert isinstance(opt, muon_dist.Muon)
    expected = muon_dist.Muon(muon_dist.param_groups(model))
    assert _algorithms(opt) == _algorithms(expected)
    assert {g["lr"] for g in opt.param_groups if g["algorithm"] == "muon"} == {0.01}


def test_groups_without_algorithm_route_by_name_or_warn(caplog: pytest.LogCaptureFixture) -> None:
    model = build("llama")
    where = _algorithms(muon_dist.Muon(model.named_parameters()))
    assert where["model.embed_tokens.weight"] == where["lm_head.weight"] == "adamw"
    assert where["model.layers.0.mlp.gate_proj.weight"] == "muon"
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        muon_dist.Muon([{"params": list(model.parameters()), "weight_decay": 0.1}])
    assert "without names or 'algorithm'" in caplog.text and "MuonFactory" in caplog.text


def test_named_tensors_without_algorithm_follow_muon_mode(caplog: pytest.LogCaptureFixture) -> None:
    conv = torch.nn.Parameter(torch.randn(8, 3, 2, 2))
    hidden = torch.nn.Parameter(torch.randn(8, 8))
    with caplog.at_level(logging.WARNING, logger="muon_dist"):
        where = _algorithms(muon_dist.Muon([("conv.weight", conv), ("fc.weight", hidden)]))
    assert where == {"conv.weight": "adamw", "fc.weight": "muon"}
    assert "routed conv.weight (>2-D" in caplog.text and "muon_mode='flat'" in caplog.text
    flat = muon_dist.Muon([("conv.weight", conv)], muon_mode="flat")
    assert _algorithms(flat) == {"conv.weight": "muon"}
