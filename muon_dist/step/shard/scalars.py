"""The device scalars of a step, each a named view, with the one place that fills them.

:class:`StepInputs` holds what the host knows of a step (learning rates and weight decay
per group, which parameters have a local gradient and how large a norm each may have,
this rank's refusal), staged into device memory with one copy. :class:`MuonScalars`
derives from them, on the device, what the update rule reads per Muon tensor, piece,
group and step class (:mod:`muon_dist.rules.ops` says what each one is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from muon_dist.kernels.tables import HostMirror
from muon_dist.rules.forms import fused_launches
from muon_dist.rules.ops import ScalarLayout, StepScalars, stage_scalars_

# Newton–Schulz divides its input by the Frobenius norm, whose square overflows fp32 above
# about 1.84e19 (3.4e38 ** 0.5); the limit leaves room for Polar Express's 1.02 factor.
NS_NORM_LIMIT = 1.8e19 / 1.02


def norm_limit(group: dict[str, Any]) -> float:
    """The largest gradient norm a Muon parameter of ``group`` takes: its momentum stays
    below ``norm / (1 - momentum)``, and Newton–Schulz's input must stay below
    :data:`NS_NORM_LIMIT`. AdamW parameters have none."""
    if group["algorithm"] != "muon":
        return math.inf
    return NS_NORM_LIMIT * (1.0 - float(group["momentum"]))


Sliceable = TypeVar("Sliceable", torch.Tensor, "np.ndarray[Any, Any]")


@dataclass(frozen=True)
class Segments:
    """Named consecutive segments of one flat vector, sized once: views by name, and the
    slice from one segment's start to another's end, so no offset is computed by hand."""

    sizes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **sizes: int) -> Segments:
        return cls(tuple(sizes.items()))

    @property
    def numel(self) -> int:
        return sum(size for _, size in self.sizes)

    def bounds(self, first: str, last: str | None = None) -> slice:
        """From the start of segment ``first`` to the end of ``last`` (default: ``first``)."""
        start = 0
        begin = None
        for name, size in self.sizes:
            if name == first:
                begin = start
            start += size
            if name == (last or first):
                if begin is None:
                    raise KeyError(f"segment {first!r} does not come before {last!r}")
                return slice(begin, start)
        raise KeyError(f"no segment {last or first!r} in {[name for name, _ in self.sizes]}")

    def views(self, buffer: Sliceable) -> dict[str, Sliceable]:
        """Each segment's view of ``buffer`` (a tensor or an array of :attr:`numel`)."""
        return {name: buffer[self.bounds(name)] for name, _ in self.sizes}


@dataclass(frozen=True)
class StepInputs:
    """A step's host values in device memory: named views of one buffer, staged by
    :meth:`stage` and moved with one host-to-device copy (``mirror.send()``, which a
    captured step's graph repeats at every replay)."""

    buffer: torch.Tensor
    lr: torch.Tensor  # per group
    weight_decay: torch.Tensor  # per group
    present: torch.Tensor  # per parameter: 1.0 where this rank has its gradient
    norm_limit: torch.Tensor  # per parameter (inf for AdamW)
    failed: torch.Tensor  # [1]: this rank's rank + 1 when it refused its inputs, else 0
    compared: torch.Tensor  # what the agreement compares across ranks (Agreement.stage)
    lr_of_group: tuple[torch.Tensor, ...]  # one-element views of ``lr`` (fused AdamW's lr)
    group_of: np.ndarray[Any, Any]  # each parameter's group index
    mirror: HostMirror  # where the host writes the values, segment by segment
    staged: dict[str, np.ndarray[Any, Any]]  # the mirror's segments by name
    # The presence flags ``staged`` holds, as last written (None: another value since).
    staged_present: list[list[bool] | None] = field(default_factory=lambda: [None])

    @classmethod
    def allocate(
        cls, groups: int, group_of: Sequence[int], compared: int, device: torch.device
    ) -> StepInputs:
        """The buffer of a step over ``groups`` groups and a parameter per ``group_of``
        entry (its group's index), ``compared`` values compared across ranks."""
        layout = Segments.of(
            lr=groups,
            weight_decay=groups,
            present=len(group_of),
            norm_limit=len(group_of),
            failed=1,
            compared=compared,
        )
        buffer = torch.zeros(layout.numel, device=device)
        views = layout.views(buffer)
        mirror = HostMirror(buffer)
        return cls(
            buffer,
            lr=views["lr"],
            weight_decay=views["weight_decay"],
            present=views["present"],
            norm_limit=views["norm_limit"],
            failed=views["failed"],
            compared=views["compared"],
            lr_of_group=tuple(views["lr"].unbind(0)),
            group_of=np.asarray(group_of, dtype=np.int64),
            mirror=mirror,
            staged=layout.views(mirror.array),
        )

    def stage(
        self,
        groups: Sequence[dict[str, Any]],
        present: Sequence[bool],
        failed_rank: int | None,
        compared: Sequence[float],
    ) -> None:
        """Write this step's values to the host buffer, which the step copies in first
        (``mirror.send()``). A rank that refused its inputs stages nothing read from the
        groups (their options may be what it refused): zeros, no norm limits, and zeros for
        ``compared``."""
        self.mirror.wait()
        staged = self.staged
        if failed_rank is None:
            staged["lr"][:] = [float(g["lr"]) for g in groups]
            staged["weight_decay"][:] = [float(g["weight_decay"]) for g in groups]
            # A list of bools costs numpy a conversion per entry; it rarely changes.
            if present != self.staged_present[0]:
                staged["present"][:] = present
                self.staged_present[0] = list(present)
            staged["norm_limit"][:] = np.array([norm_limit(g) for g in groups])[self.group_of]
            staged["failed"][:] = 0.0
            staged["compared"][:] = compared
        else:
            for name in ("lr", "weight_decay", "present", "compared"):
                staged[name][:] = 0.0
            self.staged_present[0] = None
            staged["norm_limit"][:] = math.inf
            staged["failed"][:] = float(failed_rank + 1)


class MuonScalars:
    """What the update rule reads per Muon tensor, piece, group and step class, derived on
    the device from :class:`StepInputs` and the agreement (:func:`stage_scalars_`), with
    one-element views made once so the step takes no new view of them.

    ``group_of[j]`` is Muon tensor j's group index, ``piece_tensor[i]`` piece i's tensor,
    ``neg_scale[i]`` its ``−lr_scale``; pieces of one group and lr scale form a step
    class (``class_group``, ``class_neg_scale``), whose pieces share one step where kept.
    ``stack_tensor`` names each stacked matrix's tensor (masks of dropped matrices).
    ``backend``: the optimizer's; where it allows Triton on CUDA the scalars take one
    fused launch (:func:`fused_launches`).
    """

    def __init__(
        self,
        *,
        group_of: Sequence[int],
        cautious: Sequence[bool],
        piece_tensor: Sequence[int],
        neg_scale: Sequence[float],
        class_group: Sequence[int],
        class_neg_scale: Sequence[float],
        stack_tensor: Sequence[int],
        group_count: int,
        device: torch.device,
        backend: str,
    ) -> None:
        def tensor(values: Sequence[float | int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        tensors = len(group_of)
        cautious_mask = tensor([float(c) for c in cautious], torch.float32)
        self._layout = ScalarLayout(
            group_of=tensor(group_of, torch.long),
            plain_mask=1.0 - cautious_mask,
            cautious_mask=cautious_mask,
            piece_tensor=tensor(piece_tensor, torch.long),
            neg_scale=tensor(neg_scale, torch.float32),
            class_group=tensor(class_group, torch.long),
            class_neg_scale=tensor(class_neg_scale, torch.float32),
            stack_tensor=tensor(stack_tensor, torch.long),
        )
        self._out = StepScalars(
            # The agreed mask, copied in; per stacked matrix, whether the step drops it.
            keep=torch.ones(tensors, dtype=torch.bool, device=device),
            # Per tensor: decay factor (1 where cautious) and cautious rate; per piece: step.
            decay=torch.ones(tensors, device=device),
            cautious=torch.zeros(tensors, device=device),
            step=torch.zeros(len(piece_tensor), device=device),
            ok=torch.ones((), dtype=torch.bool, device=device),  # not found_inf
            # Per group and per step class, for tensors with a local gradient (kept exactly
            # when the step is): the decay factor and the step.
            group_decay=torch.ones(group_count, device=device),
            class_step=torch.zeros(len(class_group), device=device),
            dropped=torch.zeros(len(stack_tensor), dtype=torch.bool, device=device),
        )
        self._fused = fused_launches(backend, self._out.keep)
        out = self._out
        self.keep, self.dropped, self.ok = out.keep, out.dropped, out.ok
        self.decay, self.cautious, self.step = out.decay, out.cautious, out.step
        self.group_decay, self.class_step = out.group_decay, out.class_step
        self.keep_of = self.keep.unbind(0)
        self.decay_of = self.decay.unbind(0)
        self.cautious_of = self.cautious.unbind(0)
        self.step_of = self.step.unbind(0)
        self.group_decay_of = self.group_decay.unbind(0)
        self.class_step_of = self.class_step.unbind(0)
        # Magma's per-row steps of its pieces, set by the step after its scores advance.
        self.magma_step_of: dict[int, torch.Tensor] = {}

    def stage(
        self, keep: torch.Tensor, found_inf: torch.Tensor, inputs: StepInputs, drop: bool
    ) -> None:
        """This step's scalars from the agreed ``keep`` and ``found_inf``; ``drop``: mark
        the stacked matrices of the tensors it does not keep (zeroed before Newton–Schulz)."""
        stage_scalars_(
            inputs.lr,
            inputs.weight_decay,
            keep,
            found_inf,
            self._layout,
            self._out,
            drop=drop,
            fused=self._fused,
        )

    def drop_none(self) -> None:
        """Drop no stacked matrix (a step whose buckets start before the agreement)."""
        self.dropped.zero_()
