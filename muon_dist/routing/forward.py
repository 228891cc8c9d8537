"""Run a model's forward once on the meta device and observe every parameter's use.

Nothing is allocated: each parameter and buffer is swapped for a meta tensor of its full
shape (``torch.func.functional_call``; a DTensor's global shape), the inputs are moved to
meta, and the module hooks (FSDP2's all-gathers among them) are off for the call, so no
collective runs and every rank observes the same. Inputs are the caller's
``example_inputs`` or the model's own (:mod:`muon_dist.routing.inputs`). A forward that
cannot run on meta as the model stands is tried again in bfloat16 (grouped expert kernels
take only that), then in eval mode where the model is in training mode (a training-only
check that reads values: RT-DETR's encoder asks ``torch.isfinite(h).all()`` of its
activations), each plan of inputs in turn, then given up: the caller routes without
observation. Where a fallback observed the model, the INFO log says which.

Repeated blocks (the members of one ``ModuleList`` of one class, parameter shapes and
settings: 80 decoder layers) are observed once: a product entering a member is not
followed inside it, so every member is observed alike. The first member called is traced;
the others take what it showed inside (renumbered to their own parameters) and hand on
the codes its outputs held, so what follows them is observed as if every member were
traced. Called as the traced member was (:mod:`muon_dist.routing.shortcut`), they do not
run: they give fresh meta tensors laid out as its outputs; called otherwise, or where a
hook inside them would miss their forward, they run untraced. Where the forward then
fails, it is traced again with every member run: one that did not run left out what its
forward does besides its outputs (a cache it fills), which later code may read.
Observation costs about one member's forward at any depth.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from muon_dist.routing.inputs import Call, plans
from muon_dist.routing.names import normalize_fqn
from muon_dist.routing.observation import Observation, observation
from muon_dist.routing.shortcut import Shown, watched
from muon_dist.routing.trace import Record, Tracer

logger = logging.getLogger(__name__)

# Outputs that are not the model's prediction: states, attention maps, caches, routers.
_NOT_PREDICTION = re.compile(r"hidden_state|attention|past_key_values|cache|router|aux")


_NO_INPUTS = "no example_inputs and the model has no dummy inputs"


@dataclass(frozen=True)
class Observations:
    """Observations by normalised parameter name; ``error`` says why none were made;
    ``ran``: whether a forward was tried (there were inputs and observation was on)."""

    by_name: Mapping[str, Observation] = field(default_factory=dict)
    error: str | None = None
    ran: bool = True


def observe(model: nn.Module, example_inputs: Any = None, *, twins: bool = True) -> Observations:
    """Observe ``model``'s forward on ``example_inputs`` (a dict of keyword arguments, a
    tuple of positional ones or one tensor) or, where None, on the model's own; ``twins``:
    repeated blocks are traced once (False traces every member, for the test that both
    agree)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile: the module it wraps
    tried = plans(model, example_inputs)
    if not tried:
        return Observations(error=_NO_INPUTS, ran=False)
    named = list(_unique_parameters(model))
    failed: list[tuple[str, str]] = []  # (the try, its error)
    plainest = 0  # where the tries of the last plan (the plainest inputs) begin
    for plan in tried:
        plainest = len(failed)
        for mode in _modes(model):
            try:
                with _eval(model, mode.evaluating):
                    tracer = _trace(model, plan.calls, len(named), mode, twins)
            except Exception as e:
                text = str(e).splitlines()[0][:200] if str(e) else ""
                failed.append((f"{mode.words} on {plan.label}", f"{type(e).__name__}: {text}"))
                continue
            if failed:
                logger.info(
                    "muon_dist.param_groups observed the forward %s on %s; it does not run %s",
                    mode.words,
                    plan.label,
                    "; ".join(f"{where} ({error})" for where, error in failed),
                )
            return Observations(_observations(tracer, named))
    logger.info(
        "muon_dist.param_groups: the forward does not run %s",
        "; ".join(f"{where} ({error})" for where, error in failed),
    )
    if all(plan.guessed for plan in tried):  # a guess at its inputs is not its inputs
        return Observations(error=f"{_NO_INPUTS} (nor did it run on {tried[0].label})", ran=False)
    where = "on the meta device or on its own tensors" if _real(model) else "on the meta device"
    return Observations(error=f"its forward does not run {where} ({failed[plainest][1]})")


def _trace(model: nn.Module, calls: list[Call], count: int, mode: Mode, twins: bool) -> Tracer:
    """The calls traced, the untraced twins answered for without running them; where that
    fails, traced again with them run (see the module's docstring)."""
    tracer = Tracer(count)
    blocks = _Twins(model, tracer, twins, shortcut=True)
    try:
        _run(model, calls, tracer, mode, blocks)
        return tracer
    except Exception as e:
        if not blocks.answered:
            raise
        logger.debug(
            "muon_dist.param_groups runs the untraced twins: not running them failed (%r)", e
        )
    tracer = Tracer(count)
    _run(model, calls, tracer, mode, _Twins(model, tracer, twins, shortcut=False))
    return tracer


def _observations(tracer: Tracer, named: list[tuple[str, torch.Tensor]]) -> dict[str, Observation]:
    """What the traced forward says of each parameter it reached, by name."""
    by_name = {}
    for index, (name, p) in enumerate(named):
        seen = observation(tracer.records[index], tuple(p.shape), index in tracer.outputs)
        if seen is not None:
            by_name[name] = seen
    return by_name


class Mode(NamedTuple):
    """One try of a forward: in the ``words`` of the log; ``dtype`` of the meta stand-ins
    (None: the parameters' own); in eval mode; on the model's ``real`` tensors instead of
    meta stand-ins."""

    words: str
    dtype: torch.dtype | None = None
    evaluating: bool = False
    real: bool = False


# The most parameters a model may have for a try on its own tensors, a forward of one
# short sequence that reads values (``.item()``, ``nonzero``) where meta has none.
REAL_LIMIT = 2_000_000_000


def _real(model: nn.Module) -> bool:
    """Whether the model's own tensors can run its forward: none on meta, none a DTensor
    (whose shards one rank cannot run alone), at most :data:`REAL_LIMIT` parameters."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta or isinstance(t, DTensor) for t in tensors):
        return False
    return sum(p.numel() for p in model.parameters()) <= REAL_LIMIT


def _modes(model: nn.Module) -> list[Mode]:
    """Each try: on meta as the model stands, in bfloat16, and in eval mode where some
    module is in training mode; then, where the model's own tensors can run it
    (:func:`_real`), on them, as it stands and in eval mode."""
    training = any(m.training for m in model.modules())
    tries = [Mode("as it stands"), Mode("in bfloat16", torch.bfloat16)]
    tries += [Mode("in eval mode", evaluating=True)] if training else []
    if _real(model):
        tries.append(Mode("on its own tensors", real=True))
        tries += [Mode("on its own tensors in eval mode", evaluating=True, real=True)] * training
    return tries


@contextmanager
def _eval(model: nn.Module, evaluating: bool) -> Iterator[None]:
    """The model in eval mode for the call where ``evaluating``; each module's own mode
    restored after."""
    saved = [(m, m.training) for m in model.modules()]
    if evaluating:
        model.eval()
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


class _Twins:
    """The repeated blocks of one observation: hooks that give each member fresh inputs,
    trace the first member called of each group and run the others untraced, or where
    ``shortcut``, answer for them as their traced twin did (:mod:`.shortcut`)."""

    def __init__(self, model: nn.Module, tracer: Tracer, skip: bool, shortcut: bool) -> None:
        self.tracer = tracer
        self.skip = skip
        self.shortcut = skip and shortcut
        index = {id(p): i for i, (_, p) in enumerate(_unique_parameters(model))}
        self.group: dict[nn.Module, int] = {}
        self.indices: dict[nn.Module, list[int]] = {}
        for g, members in enumerate(_repeated_blocks(model)):
            for m in members:
                self.group[m] = g
                self.indices[m] = [
                    index[id(p)] for _, p in m.named_parameters(remove_duplicate=False)
                ]
        self.traced: dict[int, nn.Module] = {}  # group -> its member that is traced
        self.carried: dict[int, list[Any]] = {}  # group -> what its traced outputs held
        self.inside: dict[int, list[Record]] = {}  # group -> its traced member's records
        self.pausing: list[nn.Module] = []  # the untraced members running now
        self.shown: dict[int, Shown | None] = {}  # group -> its traced member's last call
        self.answered = 0  # untraced calls answered without running

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """Hooks on every member and, where answering for the untraced, a forward of its
        own; the members restored after."""
        handles = []
        for member in self.group:
            handles.append(member.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(member.register_forward_hook(self._leave, with_kwargs=True))
        wrapped = [(m, m.__dict__.get("forward")) for m in self.group if self.shortcut]
        for member, _ in wrapped:
            member.__dict__["forward"] = partial(self._forward, member, member.forward)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for member, own in wrapped:
                if own is None:
                    del member.__dict__["forward"]
                else:
                    member.__dict__["forward"] = own

    def _forward(
        self, member: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """The traced member's call, noted; an untraced member's answered from it where
        it was called alike and no hook inside would miss it, else run."""
        g = self.group[member]
        if self.pausing and self.pausing[-1] is member:
            shown = self.shown.get(g)
            given, spec = tree_flatten((args, kwargs))
            if shown is not None and shown.fits(given, spec) and not watched(member, self):
                self.answered += 1
                return shown.answer(given)
        elif not self.tracer.paused and self.traced.get(g) is member:
            before = Shown.keys_of((args, kwargs))
            out = forward(*args, **kwargs)
            self.shown[g] = Shown.of(before, (args, kwargs), out, self.tracer.is_parameter)
            return out
        return forward(*args, **kwargs)

    def _enter(self, member: nn.Module, args: Any, kwargs: Any) -> Any:
        if self.tracer.paused:
            return None
        if self.skip and self.traced.setdefault(self.group[member], member) is not member:
            self.pausing.append(member)
            self.tracer.paused += 1
            return None
        return self.tracer.fresh((args, kwargs))

    def _leave(self, member: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        g = self.group[member]
        if self.pausing and self.pausing[-1] is member:
            self.pausing.pop()
            self.tracer.paused -= 1
            if not self.tracer.paused and g in self.carried:
                remap = dict(zip(self.indices[self.traced[g]], self.indices[member], strict=True))
                self.tracer.carry(out, self.carried[g], remap)
            # What its traced twin's forward showed inside it, renumbered; filled as it
            # leaves, so that a twin nested in a traced member is whole when that member's
            # records are taken (RT-DETR's box heads, each a list of twin layers).
            for i, inside in zip(self.indices[member], self.inside.get(g, []), strict=False):
                self.tracer.records[i].absorb(inside)
        elif self.skip and not self.tracer.paused:
            self.carried[g] = self.tracer.carried(out)
            self.inside[g] = [self.tracer.records[i].copy() for i in self.indices[member]]


def _repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The groups of two or more members of one ``ModuleList`` that are twins: the same
    class, parameter and buffer names, shapes and dtypes, and settings (every plain
    attribute of every submodule, but one that is each member's own position: a layer
    index)."""
    found: list[list[nn.Module]] = []
    for holder in model.modules():
        if not isinstance(holder, nn.ModuleList) or len({id(m) for m in holder}) < len(holder):
            continue  # one module called twice is itself, not a twin
        kinds: dict[tuple[Any, ...], list[tuple[int, nn.Module, dict[str, Any]]]] = {}
        for position, member in enumerate(holder):
            tensors, settings = _signature(member)
            kinds.setdefault((type(member), tensors, tuple(settings)), []).append(
                (position, member, settings)
            )
        for kind in kinds.values():
            index = {
                key
                for key in kind[0][2]
                if all(type(s[key]) is int and s[key] == at for at, _, s in kind)
            }
            groups: dict[str, list[nn.Module]] = {}
            for _, member, settings in kind:
                rest = {k: v for k, v in settings.items() if k not in index}
                groups.setdefault(repr(rest), []).append(member)
            found += [group for group in groups.values() if len(group) > 1]
    return found


def _signature(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The module's tensors (names, types, shapes, dtypes) and plain settings by name."""
    tensors: list[tuple[Any, ...]] = [
        (n, type(t), tuple(t.shape), t.dtype) for n, t in module.named_parameters()
    ]
    tensors += [(n, type(t), tuple(t.shape), t.dtype) for n, t in module.named_buffers()]
    settings = {
        f"{prefix}:{key}": value
        for prefix, sub in module.named_modules()
        for key, value in vars(sub).items()
        if not key.startswith("_")
        and (value is None or isinstance(value, (bool, int, float, str, tuple)))
    }
    return tuple(tensors), settings


def _unique_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield normalize_fqn(name), p


@contextmanager
def _hooks_off(model: nn.Module) -> Iterator[None]:
    """No module hooks for the call (FSDP2 all-gathers, user hooks) but Transformers' output
    capture, which is part of the forward (a vision tower's hidden states that a projector
    reads): it installs its hooks once per model, on the first forward that asks, and then
    counts on them. Restored after, with the hooks the call installed (ours are removed by
    their handles): the model's later forwards, and observations, find them."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, pre, post in saved:
        m._forward_pre_hooks = OrderedDict((k, h) for k, h in pre.items() if _captures(h))
        m._forward_hooks = OrderedDict((k, h) for k, h in post.items() if _captures(h))
    try:
        yield
    finally:
        for m, pre, post in saved:
            pre.update((k, h) for k, h in m._forward_pre_hooks.items() if k not in pre)
            post.update((k, h) for k, h in m._forward_hooks.items() if k not in post)
            m._forward_pre_hooks = pre
            m._forward_hooks = post


def _captures(hook: Any) -> bool:
    """Whether a hook is Transformers' output capture."""
    return str(getattr(hook, "__module__", "")).startswith("transformers.utils.output_capturing")


def _meta(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(tuple(t.shape), dtype=cast, device="meta")


def _run(model: nn.Module, calls: list[Call], tracer: Tracer, mode: Mode, blocks: _Twins) -> None:
    """Each call on meta stand-ins for the parameters (the tracer's, in order) and
    buffers, or on the model's own tensors where ``mode.real``; the parameters whose
    products reach a prediction output are noted. The repeated ``blocks`` are hooked."""
    params = {id(p): i for i, (_, p) in enumerate(_unique_parameters(model))}
    stand_ins = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        own = p.detach() if mode.real else _meta(p, mode.dtype)
        stand_ins[name] = tracer.param(params[id(p)], own)
    for name, b in model.named_buffers(remove_duplicate=False):
        # Copies of the real buffers: a forward in training mode updates some (batch
        # norm's running statistics), which the model must not see.
        stand_ins[name] = b.clone() if mode.real else _meta(b, mode.dtype)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def moved(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        return a.to(device) if mode.real else _meta(a, mode.dtype)

    # A real forward draws random numbers (dropout): the caller's generators are restored.
    devices = [device] if mode.real and device.type == "cuda" else []
    with torch.random.fork_rng(devices, enabled=mode.real), torch.no_grad():
        _calls(model, calls, tracer, blocks, moved, stand_ins)


def _calls(
    model: nn.Module,
    calls: list[Call],
    tracer: Tracer,
    blocks: _Twins,
    moved: Callable[[Any], Any],
    stand_ins: dict[str, torch.Tensor],
) -> None:
    """The calls of :func:`_run`, traced, on ``stand_ins``, the inputs ``moved`` to them."""
    with _hooks_off(model), tracer, blocks.hooked():
        for method, args, kwargs in calls:
            args, kwargs = tree_map(moved, (args, kwargs))
            with _reparametrize_module(model, stand_ins):
                out = getattr(model, method)(*args, **kwargs) if method else model(*args, **kwargs)
            if method is None:
                for key, value in _outputs(out):
                    if not _NOT_PREDICTION.search(key):
                        tracer.reached(value)


def _outputs(out: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of a model output (a ModelOutput or dict, a tuple, a tensor)."""
    if isinstance(out, Mapping):
        for key, value in out.items():
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor):
                    yield str(key), tensor
    else:
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                yield "", tensor
