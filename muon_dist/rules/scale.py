"""The learning-rate scale of a matrix from its full shape (``adjust_lr``), for every rule."""

from __future__ import annotations

import math

ADJUST_LR = ("spectral_norm", "rms_norm", None)


def lr_scale(out_dim: int, in_dim: int, adjust_lr: str | None) -> float:
    """Learning-rate multiplier of a matrix, from its full shape (never a shard's)."""
    if adjust_lr == "spectral_norm":
        return math.sqrt(max(1.0, out_dim / in_dim))
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(out_dim, in_dim))
    return 1.0
