"""Every option of the optimizer, declared once: its default, how its value is checked, what
it means, and when a change takes effect.

The constructor builds its group defaults and execution settings from these declarations,
validation runs their checks, ``load_state_dict`` fills the keys an older checkpoint lacks
with their defaults (the behaviour before the key existed), the step checks the
``per_step`` values at every step, and the tests hold the constructor's signature and the
README's options table to them. Every option must be the same on every rank that holds the
parameters (:mod:`muon_dist.dist.consensus` at construction; the ``per_step`` values also at
each step, :mod:`muon_dist.step.agreement`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from muon_dist.kernels.dispatch import validate_backend
from muon_dist.kernels.gram import METHODS as NS_METHODS
from muon_dist.plan.build import REPLICA_MODES
from muon_dist.plan.views import MUON_MODES
from muon_dist.rules.registry import RULES
from muon_dist.rules.scale import ADJUST_LR

# A check: (where, key, value) -> None, raising ValueError or TypeError naming all three.
Check = Callable[[str, str, Any], None]


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number as the options take them: an int or a float
    (NumPy's included), never a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def number(where: str, key: str, value: Any) -> float:
    """A finite real number given as a Python or NumPy int or float. A tensor, a bool, a
    string, a ``Decimal`` or a ``Fraction`` is refused: fused AdamW and the device staging
    of the step read plain numbers, and would fail mid-step on anything else."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{where}: {key} is a tensor ({value!r}); pass a Python float "
            f"(e.g. {key}={float(value.detach().cpu().reshape(-1)[0])}): the step stages "
            "every group's hyper-parameters into device memory itself"
        )
    if not is_real(value):
        raise TypeError(
            f"{where}: {key}={value!r} is a {type(value).__name__}; pass a Python int or "
            f"float (e.g. {key}=float(...))"
        )
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key}={value!r} is not finite; pass a finite number")
    return float(value)


def count(where: str, key: str, value: Any, low: int) -> int:
    """An int (not a bool, not a float with an integral value) of at least ``low``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{where}: {key}={value!r} is a {type(value).__name__}; pass an int >= {low}"
        )
    if value < low:
        raise ValueError(f"{where}: {key}={value!r} must be >= {low}")
    return int(value)


def at_least(low: float) -> Check:
    def check(where: str, key: str, value: Any) -> None:
        if number(where, key, value) < low:
            raise ValueError(f"{where}: {key}={value!r} must be >= {low}")

    return check


def count_from(low: int) -> Check:
    def check(where: str, key: str, value: Any) -> None:
        count(where, key, value, low)

    return check


def unit(where: str, key: str, value: Any) -> None:
    """``value`` in [0, 1), as momentum and betas must be."""
    if not 0.0 <= number(where, key, value) < 1.0:
        raise ValueError(f"{where}: {key}={value!r} is out of range; it must lie in [0.0, 1.0)")


def flag(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {key}={value!r}; choose True or False")


def one_of(choices: Sequence[Any]) -> Check:
    def check(where: str, key: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(
                f"{where}: {key}={value!r} is not supported; choose one of {list(choices)}"
            )

    return check


def rule(where: str, key: str, value: Any) -> None:
    """A registered update rule (read at check time: a rule may be registered later)."""
    one_of(tuple(RULES))(where, key, value)


def betas(where: str, key: str, value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{where}: {key}={value!r} must be a pair (beta1, beta2)")
    unit(where, f"{key}[0]", value[0])
    unit(where, f"{key}[1]", value[1])


def dion2_fraction(where: str, key: str, value: Any) -> None:
    if not 0.0 < number(where, key, value) <= 1.0:
        raise ValueError(
            f"{where}: {key}={value!r} is out of range; it must lie in (0.0, 1.0] (the share "
            "of each matrix's slices Dion2 orthogonalizes; 0.25 is the paper's choice, 1.0 "
            "is Muon)"
        )


def normuon_eps(where: str, key: str, value: Any) -> None:
    if number(where, key, value) <= 0.0:
        raise ValueError(
            f"{where}: {key}={value!r} must be > 0 (e.g. 1e-8): it keeps a row whose second "
            "moment is zero from dividing by zero"
        )


def dtype(where: str, key: str, value: Any) -> None:
    if value not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: {key}={value}; choose torch.bfloat16 or torch.float32")


def backend(where: str, key: str, value: Any) -> None:
    validate_backend(value)


@dataclass(frozen=True)
class Option:
    """One option: its key, default and check, and what it means.

    ``check`` is None where the option is checked together with others (the Newton–Schulz
    schedule by :func:`muon_dist.kernels.coefficients.resolve_coefficients`, a parameter's
    view options by :func:`muon_dist.plan.views.matrix_views`). ``argument`` is the
    constructor's argument that sets it (None: set per group only). ``per_step`` options
    may change between steps (schedulers change them); the others are read when the step
    is built.
    """

    key: str
    default: Any
    check: Check | None
    meaning: str
    argument: str | None = None
    per_step: bool = False


def _muon(key: str, default: Any, check: Check | None, meaning: str, **kw: Any) -> Option:
    return Option(key, default, check, meaning, argument=kw.pop("argument", key), **kw)


MUON_OPTIONS: tuple[Option, ...] = (
    _muon("lr", 0.02, at_least(0.0), "Muon's learning rate", per_step=True),
    _muon("momentum", 0.95, unit, "momentum coefficient", per_step=True),
    _muon("nesterov", True, flag, "Newton–Schulz reads G + beta M, else M", per_step=True),
    _muon("weight_decay", 0.0, at_least(0.0), "decoupled weight decay", per_step=True),
    _muon("adjust_lr", "spectral_norm", one_of(ADJUST_LR), "lr scale from the full shape"),
    _muon("ns_steps", 5, None, "Newton–Schulz iterations"),
    _muon("coefficients", "quintic", None, "Newton–Schulz coefficient schedule"),
    _muon("ns_method", "auto", one_of(NS_METHODS), "standard or Gram Newton–Schulz"),
    _muon("muon_mode", "2d", one_of(MUON_MODES), "how >2-D weights are viewed as matrices"),
    _muon("experts", False, None, "3-D expert stacks", argument=None),
    _muon("num_experts", None, None, "fused expert count", argument=None),
    _muon("num_heads", None, None, "orthogonalize per head", argument=None),
    _muon("split_sizes", None, None, "fused row blocks", argument=None),
    _muon("split_groups", 1, None, "fused parts repeated along the outputs", argument=None),
    _muon("transposed", False, None, "stored [in, out]", argument=None),
    _muon("magma", False, flag, "Magma-lite damping"),
    _muon("magma_beta", 0.9, unit, "EMA coefficient of Magma's score"),
    _muon("rule", "muon", rule, "the update rule of Muon groups"),
    _muon("normuon_beta2", 0.95, unit, "NorMuon's EMA of the row second moments"),
    _muon("normuon_eps", 1e-8, normuon_eps, "NorMuon's epsilon"),
    _muon("dion2_fraction", 0.25, dion2_fraction, "Dion2's share of slices"),
    _muon("cautious_wd", False, flag, "decay only weights the update's sign agrees with"),
)

ADAMW_OPTIONS: tuple[Option, ...] = (
    Option("lr", 3e-4, at_least(0.0), "AdamW's learning rate", "adamw_lr", per_step=True),
    Option("betas", (0.9, 0.95), betas, "AdamW's betas", "adamw_betas", per_step=True),
    Option("eps", 1e-8, at_least(0.0), "AdamW's epsilon", "adamw_eps", per_step=True),
    Option("weight_decay", 0.0, at_least(0.0), "AdamW's weight decay", "adamw_weight_decay", True),
)

SETTINGS: tuple[Option, ...] = (
    Option("backend", "auto", backend, "kernels: torch, triton or auto", "backend"),
    Option("comm_dtype", torch.bfloat16, dtype, "dtype of the exchanges", "comm_dtype"),
    Option("ns_dtype", torch.bfloat16, dtype, "dtype Newton–Schulz runs in", "ns_dtype"),
    Option("bucket_bytes", 128 * 2**20, count_from(1), "bytes per bucket", "bucket_bytes"),
    Option("max_inflight", 3, count_from(1), "buckets in flight", "max_inflight"),
    Option("replica_mode", "split", one_of(REPLICA_MODES), "HSDP replicas", "replica_mode"),
    Option("nonfinite", "raise", one_of(("raise", "skip_step")), "on non-finite", "nonfinite"),
    Option("cuda_graph", False, flag, "capture the step in a CUDA graph", "cuda_graph"),
    Option("graph_warmup", 2, count_from(1), "eager steps before capture", "graph_warmup"),
    Option("overlap", "none", one_of(("none", "backward")), "start in backward", "overlap"),
)

OPTIONS: dict[str, tuple[Option, ...]] = {"muon": MUON_OPTIONS, "adamw": ADAMW_OPTIONS}


def group_defaults(algorithm: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A group's defaults from the constructor's ``arguments`` (by argument name); the
    options that no argument sets take their declared default."""
    return {
        "algorithm": algorithm,
        **{
            o.key: o.default if o.argument is None else arguments[o.argument]
            for o in OPTIONS[algorithm]
        },
    }


def missing_filled(group: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """``group`` with the options it lacks (a checkpoint saved before they existed) set to
    their declared defaults, the behaviour before they existed."""
    return {**{o.key: o.default for o in OPTIONS[algorithm]}, **group}


def check_options(group: dict[str, Any], where: str, per_step: bool | None = None) -> None:
    """Run the declared check of every option of ``group``'s algorithm (only the ``per_step``
    ones, or only the others, when ``per_step`` is given)."""
    for option in OPTIONS[group["algorithm"]]:
        if option.check is not None and per_step in (None, option.per_step):
            option.check(where, option.key, group[option.key])
