"""transformers' Trainer and accelerate with Muon routed by the model's structure, and
Muon given groups without "algorithm" (what the Trainer passes an optimizer class)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from model_families import batch, build, loss_of

import muon_dist

pytest.importorskip("transformers", reason="install the 'models' extra: pip install -e .[models]")


def _algorithms(opt: muon_dist.Muon) -> dict[str, str]:
    return {n: g["algorithm"] for n, g, _ in muon_dist.plan.views.named_params(opt.param_groups)}


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


def test_trainer_with_factory_routes_like_param_groups_and_trains(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    from muon_dist.integrations.hf_trainer import MuonFactory

    model = build("gpt2")
    rows = [{"input_ids": ids, "labels": ids} for ids in batch()]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_steps=1,
    )
    options = {"lr": 0.02, "adamw_lr": 3e-3, "conv": "adamw"}
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        optimizer_cls_and_kwargs=(MuonFactory, options),
    )
    opt = trainer.create_optimizer()
    assert isinstance(opt, muon_dist.Muon)
    assert _algorithms(opt) == _algorithms(muon_dist.Muon(muon_dist.param_groups(model)))
    assert {g["lr"] for g in opt.param_groups if g["algorithm"] == "muon"} == {0.02}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


def test_accelerate_prepares_accumulates_saves_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="install the 'models' extra")
    from accelerate import Accelerator

    model = build("gpt2")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    opt = muon_dist.Muon(muon_dist.param_groups(model), lr=0.02, adamw_lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    ids = batch()

    def step() -> None:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model, ids))
            opt.step()
            opt.zero_grad()

    weights = [p.detach().clone() for p in model.parameters()]
    step()  # accumulates: no update yet
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    step()
    assert not all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    accelerator.save_state(str(tmp_path))
    step()
    step()
    continued = [p.detach().clone() for p in model.parameters()]
    accelerator.load_state(str(tmp_path))
    step()
    step()
    for a, b in zip(continued, model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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
