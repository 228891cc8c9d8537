"""Whether the Triton backend can run here: a leaf module, so kernels and drivers import it
without importing each other (and without importing Triton)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), as it decides."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """True where the Triton backend can run: Triton imports and CUDA or the interpreter is on."""
    return _triton_importable() and (torch.cuda.is_available() or interpret_mode())


def on_device(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Triton launches on the current CUDA device, which need not be the tensor's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
