"""The rank side of the edit fuzz test (test_fuzz_edits.py): train an FSDP2 model with
the drawn edits in each overlap mode, and report each mode's outcome, never raising.

Three steps take the edits, three more follow. A step that raises is refused: every rank
sets its groups back to what they held before the step's edits and takes the step again,
from a new backward, without its edits. The run reports which steps were refused and a
digest of the parameters and state at the end, to compare with a run that never made the
refused edits.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from overlap_cases import _batch, _model, _optimizer, _scale_grads, _snapshot

import muon_dist

GRAD_EDITS = ("clip_grad_norm_", "grad.mul_")
EDITED_STEPS = 3
MORE_STEPS = 3


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


def _set_back(opt: muon_dist.Muon, saved: list[dict[str, Any]]) -> None:
    for group, values in zip(opt.param_groups, saved, strict=True):
        for key in [k for k in group if k not in ("params", "param_names")]:
            del group[key]
        group.update(copy.deepcopy(values))


def _run(overlap: str, edits: list[dict[str, Any]], rule: str) -> tuple[str, Any, str]:
    model, groups = _model(dist.get_world_size(), "fsdp")
    refused: list[int] = []
    try:
        opt = _optimizer(groups, overlap, "raise", rule=rule)
        step = 0
        while step < EDITED_STEPS + MORE_STEPS:
            saved = [
                copy.deepcopy({k: v for k, v in g.items() if k not in ("params", "param_names")})
                for g in opt.param_groups
            ]
            now = [] if step in refused else [e for e in edits if e["step"] == step]
            opt.zero_grad()
            for edit in now:
                if edit["when"] == "before backward":
                    _apply(edit, model, opt)
            model(_batch(step, 0)).square().mean().backward()
            for edit in now:
                if edit["when"] == "after backward":
                    _apply(edit, model, opt)
            try:
                opt.step()
            except (ValueError, TypeError, RuntimeError):
                if step in refused:
                    raise
                refused.append(step)
                _set_back(opt, saved)
                continue
            step += 1
    except Exception as exc:  # every outcome is reported, none raised
        return "error", refused, f"{type(exc).__name__}: {exc}"
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in _snapshot(model, opt)))
    return "ok", refused, digest.hexdigest()


def edit_worker(
    rank: int, world_size: int, edits: list[dict[str, Any]], rule: str = "muon"
) -> dict[str, Any]:
    """Each mode's outcome on this rank, ``(kind, refused steps, digest or error)``, and the
    outcome of the plain run without the edits of the steps refused in it: the run that never
    made them."""
    logging.getLogger("muon_dist").setLevel(logging.CRITICAL)
    outcomes = {overlap: _run(overlap, edits, rule) for overlap in ("none", "backward")}
    refused = set(outcomes["none"][1])
    kept = [e for e in edits if e["step"] not in refused]
    return {**outcomes, "never made": _run("none", kept, rule)}
