"""The rank side of the edit fuzz test (test_fuzz_edits.py): train an FSDP2 model three
steps in each overlap mode with the drawn edits, and report each mode's outcome, never
raising."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from overlap_cases import _batch, _model, _optimizer, _scale_grads, _snapshot

import muon_dist

GRAD_EDITS = ("clip_grad_norm_", "grad.mul_")


def _apply(edit: dict[str, Any], model: torch.nn.Module, opt: muon_dist.Muon) -> None:
    if edit["rank0_only"] and dist.get_rank() != 0:
        return
    key, value = edit["key"], edit["value"]
    if key == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), value)
    elif key == "grad.mul_":
        _scale_grads(model, value)
    else:
        opt.param_groups[edit["group"]][key] = value


def _run(overlap: str, edits: list[dict[str, Any]]) -> tuple[str, str]:
    model, groups = _model(dist.get_world_size(), "fsdp")
    try:
        opt = _optimizer(groups, overlap, "raise")
        for step in range(3):
            opt.zero_grad()
            for edit in edits:
                if edit["step"] == step and edit["when"] == "before backward":
                    _apply(edit, model, opt)
            model(_batch(step, 0)).square().mean().backward()
            for edit in edits:
                if edit["step"] == step and edit["when"] == "after backward":
                    _apply(edit, model, opt)
            opt.step()
    except Exception as exc:  # every outcome is reported, none raised
        return "error", type(exc).__name__
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in _snapshot(model, opt)))
    return "ok", digest.hexdigest()


def edit_worker(rank: int, world_size: int, edits: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's outcome on this rank: ``("ok", digest of parameters and state)`` or
    ``("error", the exception's type)``."""
    logging.getLogger("muon_dist").setLevel(logging.CRITICAL)
    return {overlap: _run(overlap, edits) for overlap in ("none", "backward")}
