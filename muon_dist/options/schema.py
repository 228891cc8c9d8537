"""Every option of the optimizer, declared once: its default, how its value is checked, what
it means, and when a change takes effect.

The constructor builds its group defaults and execution settings from these declarations,
validation runs their checks, ``load_state_dict`` fills the keys an older checkpoint lacks
with their defaults (the behaviour before the key existed), the step checks the
``per_step`` values at every step, and the tests hold the constructor's signature and the
README's options table to them. Every option must be the same on every rank that holds the
parameters (:mod:`muon_dist.comm.consensus` at construction, :mod:`muon_dist.step.agree.agreement`
at each step).

When a change takes effect: a ``per_step`` option is read by every step; a ``layout`` option
decides the matrix views or the state's layout, so it is fixed once the state exists (a
change is refused, naming it); any other option is read when the step is built, and a change
rebuilds it at the next step (:mod:`muon_dist.step.changes`).
"""

from __future__ import annotations

import math
import textwrap
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


def cuda_graph(where: str, key: str, value: Any) -> None:
    """True, False or ``"auto"`` (a string other than ``"auto"``: ValueError; any other
    type, an int included: TypeError)."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return
    error = ValueError if isinstance(value, str) else TypeError
    raise error(
        f"{where}: {key}={value!r} is not supported; choose 'auto' (capture where the job "
        "allows, the default), True (always capture) or False (never)"
    )


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


# What ``momentum_dtype`` stores Muon's momenta in (None: each parameter's own dtype).
MOMENTUM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def momentum_dtype(where: str, key: str, value: Any) -> None:
    """None or a name of :data:`MOMENTUM_DTYPES`. A ``torch.dtype`` is refused with the
    name to pass: the group keeps a string, which every rank and every checkpoint compares
    as it was given."""
    if value is None or (isinstance(value, str) and value in MOMENTUM_DTYPES):
        return
    names = {dtype: name for name, dtype in MOMENTUM_DTYPES.items()}
    spelled = names.get(value) if isinstance(value, torch.dtype) else None
    hint = f" (for {value}: {key}={spelled!r})" if spelled else ""
    raise ValueError(
        f"{where}: {key}={value!r} is not supported; choose one of "
        f"{[None, *MOMENTUM_DTYPES]}{hint}: None keeps each momentum in its parameter's "
        "dtype, 'fp32' in float32, 'bf16' in bfloat16 (half of fp32's memory; the "
        "arithmetic stays fp32)"
    )


@dataclass(frozen=True)
class Option:
    """One option: its key, default and check, its type and what it means.

    ``check`` is None where the option is checked together with others (the Newton–Schulz
    schedule by :func:`muon_dist.kernels.coefficients.resolve_coefficients`, a parameter's
    view options by :func:`muon_dist.plan.views.matrix_views`). ``argument`` is the
    constructor's argument that sets it (None: set per group only). ``per_step`` options
    may change between steps (schedulers change them); ``layout`` ones are fixed once the
    state exists; the others are read when the step is built. ``meaning`` is the
    constructor's ``Args:`` entry for it.
    """

    key: str
    default: Any
    check: Check | None
    kind: str
    meaning: str
    argument: str | None = None
    per_step: bool = False
    layout: bool = False


def _muon(
    key: str, default: Any, check: Check | None, kind: str, meaning: str, **kw: Any
) -> Option:
    return Option(key, default, check, kind, meaning, argument=kw.pop("argument", key), **kw)


def _set(key: str, default: Any, check: Check, kind: str, meaning: str) -> Option:
    return Option(key, default, check, kind, meaning, argument=key)


MUON_OPTIONS: tuple[Option, ...] = (
    _muon("lr", 0.02, at_least(0.0), "float", "Muon's learning rate.", per_step=True),
    _muon(
        "momentum",
        0.95,
        unit,
        "float",
        r"Muon's momentum coefficient :math:`\beta`.",
        per_step=True,
    ),
    _muon(
        "nesterov",
        True,
        flag,
        "bool",
        r"feed :math:`G + \beta M` to Newton–Schulz, else :math:`M`.",
        per_step=True,
    ),
    _muon(
        "weight_decay",
        0.0,
        at_least(0.0),
        "float",
        r"Muon's decoupled weight decay :math:`\lambda`.",
        per_step=True,
    ),
    _muon(
        "adjust_lr",
        "spectral_norm",
        one_of(ADJUST_LR),
        "str | None",
        'lr scale from the full matrix shape: ``"spectral_norm"``'
        r" :math:`\sqrt{\max(1, rows/cols)}`, ``"
        '"rms_norm"`` '
        r":math:`0.2\sqrt{\max(rows, cols)}` (matches AdamW's update RMS), None: 1.",
    ),
    _muon("ns_steps", 5, None, "int", "Newton–Schulz iterations."),
    _muon(
        "coefficients",
        "quintic",
        None,
        "str | sequence",
        '``"quintic"``, ``"keller"``, ``"polar_express"`` or a list of ``(a, b, c)`` per'
        " iteration.",
    ),
    _muon(
        "ns_method",
        "auto",
        one_of(NS_METHODS),
        "str",
        '``"standard"``, ``"gram"`` or ``"auto"`` (see :func:`muon_dist.kernels.newton_schulz`).',
    ),
    _muon(
        "muon_mode",
        "2d",
        one_of(MUON_MODES),
        "str",
        '>2-D weights as ``"flat"`` ``[out, prod(rest)]`` or ``"slice"`` (one matrix per'
        ' leading index); ``"2d"`` refuses them.',
        layout=True,
    ),
    _muon(
        "experts", False, None, "bool", "3-D expert stacks (per group).", argument=None, layout=True
    ),
    _muon(
        "num_experts", None, None, "int", "fused experts (per group).", argument=None, layout=True
    ),
    _muon(
        "num_heads",
        None,
        None,
        "int",
        "orthogonalize each head's rows (per group).",
        argument=None,
        layout=True,
    ),
    _muon(
        "split_sizes",
        None,
        None,
        "list",
        "fused row blocks (per group).",
        argument=None,
        layout=True,
    ),
    _muon(
        "split_groups",
        1,
        None,
        "int",
        "fused parts repeated along the outputs.",
        argument=None,
        layout=True,
    ),
    _muon(
        "transposed",
        False,
        None,
        "bool",
        "stored ``[in, out]`` (per group).",
        argument=None,
        layout=True,
    ),
    _muon(
        "magma",
        False,
        flag,
        "bool",
        "damp each matrix's update by how well its gradient agrees with its momentum (Magma-lite).",
        layout=True,
    ),
    _muon("magma_beta", 0.9, unit, "float", "EMA coefficient of Magma's score."),
    _muon(
        "rule",
        "muon",
        rule,
        "str",
        'the update rule of Muon groups, ``"muon"``, ``"normuon"`` or ``"dion2"``'
        ' (:mod:`muon_dist.rules`; per group as ``"rule"``).',
        layout=True,
    ),
    _muon(
        "normuon_beta2",
        0.95,
        unit,
        "float",
        r"NorMuon's EMA coefficient :math:`\beta_2` of the row second moments.",
    ),
    _muon(
        "normuon_eps",
        1e-8,
        normuon_eps,
        "float",
        r"NorMuon's :math:`\epsilon`, added to :math:`\sqrt{v}` (> 0).",
    ),
    _muon(
        "dion2_fraction",
        0.25,
        dion2_fraction,
        "float",
        "the share of each matrix's slices Dion2 orthogonalizes, in (0, 1] (1 is Muon); its"
        " error-feedback decay is ``momentum``.",
    ),
    _muon("cautious_wd", False, flag, "bool", "decay only weights whose sign the update shares."),
    _muon(
        "momentum_dtype",
        None,
        momentum_dtype,
        "str | None",
        "dtype Muon's momentum is stored in: None, the parameter's (fp32 master weights:"
        ' fp32); ``"bf16"`` halves its memory and the bytes of the passes that read it, the'
        ' arithmetic staying fp32 (rounded once per store); ``"fp32"`` always float32.',
        layout=True,
    ),
)

ADAMW_OPTIONS: tuple[Option, ...] = (
    Option("lr", 3e-4, at_least(0.0), "float", "lr of AdamW groups.", "adamw_lr", True),
    Option("betas", (0.9, 0.95), betas, "tuple", "AdamW's betas.", "adamw_betas", True),
    Option("eps", 1e-8, at_least(0.0), "float", "AdamW's eps.", "adamw_eps", True),
    Option(
        "weight_decay",
        0.0,
        at_least(0.0),
        "float",
        "AdamW's weight decay.",
        "adamw_weight_decay",
        True,
    ),
)

SETTINGS: tuple[Option, ...] = (
    _set(
        "backend",
        "auto",
        backend,
        "str",
        'Newton–Schulz kernels, ``"torch"``, ``"triton"`` (CUDA) or ``"auto"`` (Triton where'
        " measured faster); also picks the fused form of the momentum and update passes.",
    ),
    _set("comm_dtype", torch.bfloat16, dtype, "torch.dtype", "dtype of gathers and scatters."),
    _set("ns_dtype", torch.bfloat16, dtype, "torch.dtype", "dtype Newton–Schulz runs in."),
    _set(
        "bucket_bytes",
        128 * 2**20,
        count_from(1),
        "int",
        "gathered matrix bytes each owner handles per bucket (of a Dion2 matrix exchanged"
        " between ranks, only the share of its slices that travels).",
    ),
    _set("max_inflight", 3, count_from(1), "int", "buckets in flight at once."),
    _set(
        "replica_mode",
        "split",
        one_of(REPLICA_MODES),
        "str",
        'HSDP replicas split the Newton–Schulz work (``"split"``) or each redo it'
        ' (``"redundant"``).',
    ),
    _set(
        "nonfinite",
        "raise",
        one_of(("raise", "skip_step")),
        "str",
        "on a non-finite gradient, raise ``FloatingPointError`` naming the parameters and the"
        ' step, or ``"skip_step"``: count it in ``skipped_steps`` and log a warning (a'
        " non-finite Newton–Schulz result skips the step too).",
    ),
    _set(
        "cuda_graph",
        "auto",
        cuda_graph,
        "bool | str",
        "capture the whole step in one CUDA graph after ``graph_warmup`` eager steps and"
        ' replay it (:mod:`muon_dist.step.launch.cuda_graph`); ``"auto"`` (the default) captures'
        " where the job allows (CUDA parameters, ``overlap`` off, NCCL collectives) and"
        " otherwise runs eagerly, saying why in one INFO log line; ``True`` captures or"
        " raises; ``False`` never captures.",
    ),
    _set("graph_warmup", 2, count_from(1), "int", "eager steps before the capture."),
    _set(
        "overlap",
        "none",
        one_of(("none", "backward", "auto")),
        "str",
        "``\"backward\"`` starts each bucket's Newton–Schulz and exchanges from FSDP2's"
        " gradient hooks during backward, and ``step()`` finishes them and commits"
        ' (:mod:`muon_dist.step.launch.backward`); ``"auto"`` times 4 steps of each mode after 2'
        " warm-up steps and keeps the faster for the rest of the run, the same on every rank"
        " (``opt.overlap_mode``; :mod:`muon_dist.step.launch.auto_overlap`). Under both, Muon"
        " parameters must be DTensors sharded by ``fully_shard``, and ``cuda_graph`` not True"
        ' (``"auto"`` runs eagerly there).',
    ),
)

# The constructor's arguments that are no option of a group and no setting.
ARGUMENTS: dict[str, str] = {
    "params": "parameters, ``(name, parameter)`` pairs, or param-group dicts (as"
    " :func:`muon_dist.param_groups` returns).",
    "qk_clip": "(sequence of QKClip, default ()): MuonClip: rescale attention query and key"
    " heads whose logits exceed tau after each step (:mod:`muon_dist.qk_clip`).",
    "max_logits": "(MaxLogitTracker | None, default None): records the logits ``qk_clip`` reads.",
    "process_group": "(ProcessGroup | None, default None): the ranks holding plain-tensor"
    " replicas, if not the world; DTensor parameters need none.",
}

OPTIONS: dict[str, tuple[Option, ...]] = {"muon": MUON_OPTIONS, "adamw": ADAMW_OPTIONS}


def args_section(arguments: Sequence[str]) -> str:
    """The constructor's ``Args:`` docstring section, in the order of ``arguments``."""
    by_argument = {
        o.argument: o for options in (*OPTIONS.values(), SETTINGS) for o in options if o.argument
    }
    lines = ["Args:"]
    for name in arguments:
        option = by_argument.get(name)
        if option is None:
            text = ARGUMENTS[name]
            entry = f"{name} {text}" if text.startswith("(") else f"{name}: {text}"
        else:
            entry = f"{name} ({option.kind}, default {_shown(option.default)}): {option.meaning}"
        lines += textwrap.wrap(entry, 88, initial_indent="    ", subsequent_indent="        ")
    per_group = ", ".join(f"``{o.key}``" for o in MUON_OPTIONS if o.argument is None)
    lines += ["", *textwrap.wrap(f"Per group also: {per_group} (README, Options).", 92)]
    return "\n".join(lines)


def _shown(default: Any) -> str:
    if isinstance(default, int) and not isinstance(default, bool) and default >= 2**20:
        return f"{default // 2**20} MiB"
    if isinstance(default, str):
        return f'"{default}"'
    return str(default)


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


# The layout options whose change only adds, drops or casts state (not the matrix views),
# so a state saved under another value loads (muon_dist.state.group_state.layout_converted),
# and what such a load does besides carrying the momenta over.
LAYOUT_STATE: dict[str, str] = {
    "rule": "the state the new value adds starts as in a new optimizer, the state it does "
    "not keep is dropped",
    "magma": "the state the new value adds starts as in a new optimizer, the state it does "
    "not keep is dropped",
    "momentum_dtype": "cast to the new dtype (to bf16: rounded once)",
}


def layout_keys(algorithm: str) -> tuple[str, ...]:
    """The options of ``algorithm`` fixed once the state exists."""
    return tuple(o.key for o in OPTIONS[algorithm] if o.layout)


def plan_keys(algorithm: str) -> tuple[str, ...]:
    """The options of ``algorithm`` read when the step is built."""
    return tuple(o.key for o in OPTIONS[algorithm] if not (o.per_step or o.layout))


def check_options(group: dict[str, Any], where: str, per_step: bool | None = None) -> None:
    """Run the declared check of every option of ``group``'s algorithm (only the ``per_step``
    ones, or only the others, when ``per_step`` is given)."""
    for option in OPTIONS[group["algorithm"]]:
        if option.check is not None and per_step in (None, option.per_step):
            option.check(where, option.key, group[option.key])
