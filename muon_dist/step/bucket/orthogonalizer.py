"""The owner's work on a stack of whole matrices: Newton–Schulz by the stack's recipe, with
the owner part of the stack's rule (its wing's, :mod:`muon_dist.step.wings`), and a device
flag per matrix of whether its result is finite."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from muon_dist.kernels.dispatch import launch_bound, newton_schulz
from muon_dist.kernels.graphs import GraphCache
from muon_dist.kernels.streams import side_stream
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import StackSpec
from muon_dist.plan.build import ns_cost
from muon_dist.plan.indices import TensorIndex
from muon_dist.rules.ops import mask_stack_, matrix_sums
from muon_dist.step.agree.failures import Failures


class OwnerPart:
    """What an owner does around Newton–Schulz on a stack; this class is Muon's: Newton–Schulz
    of the input as it is. ``graphed``: whether its Newton–Schulz replays from CUDA graphs
    whatever the stack's size. ``beside``: whether it may run on a side stream beside the
    other stacks of its bucket (it touches nothing but its stack and result)."""

    graphed = False
    beside = True

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
    ) -> torch.Tensor:
        """The owner's result for ``x`` (a stack, or one part of its matrices: ``part``)."""
        return orthogonalize(x)


# Streams a captured step spreads a bucket's launch-bound stacks over: its own and three
# side streams, each stack of a small model's bucket on its own. Each stream that runs a
# matmul keeps a cuBLAS workspace (32 MiB on Hopper) for the life of the process.
LANES = 4


def lanes(costs: Sequence[float | None], count: int = LANES) -> list[int]:
    """Each stack's lane among ``count``, 0 being the step's stream: stacks of a ``None``
    cost stay on lane 0, in order; the others, largest first, each go to the lane with the
    least cost so far, so the lanes' Newton–Schulz work ends close together."""
    load = [0.0] * count
    lane = [0] * len(costs)
    for index in sorted(
        (i for i, c in enumerate(costs) if c is not None), key=lambda i: -(costs[i] or 0.0)
    ):
        target = load.index(min(load))
        lane[index] = target
        load[target] += costs[index] or 0.0
    return lane


class Orthogonalizer:
    """Newton–Schulz on every stack of a plan. ``stack_tensor`` lists, per matrix of every
    stack in plan order, its Muon tensor; ``dropped`` (the same layout) marks the matrices a
    step drops; ``owner_of`` makes a stack's owner part (its rule's wing's). The sum of each
    matrix's result is kept (finite exactly when the result is), so a step tests every
    result at once instead of once per stack."""

    def __init__(
        self,
        settings: ExecutionSettings,
        owner_of: Callable[[StackSpec], OwnerPart],
        failures: Failures,
        stack_tensor: Sequence[TensorIndex],
        stack_sizes: Sequence[int],
        dropped: torch.Tensor,
    ) -> None:
        self._settings = settings
        self._owner_of = owner_of
        self._failures = failures
        self.stack_tensor = torch.tensor(
            list(stack_tensor), dtype=torch.long, device=dropped.device
        )
        self._tensors_of_stack = self.stack_tensor.split_with_sizes(list(stack_sizes))
        self._sums = torch.zeros(len(stack_tensor), device=dropped.device)
        self._sums_of_stack = self._sums.split_with_sizes(list(stack_sizes))
        self._dropped_of_stack = dropped.split_with_sizes(list(stack_sizes))
        # Freed with this step (the optimizer). None where the whole step is captured: its
        # capture already removes the launches, and a kernel's capture during the step's
        # eager warm-up would only hold memory (or fail) for graphs never replayed.
        self.graphs = None if settings.cuda_graph else GraphCache()
        self._owners: dict[int, OwnerPart] = {}  # per stack, made on its first step

    def _owner(self, spec: StackSpec) -> OwnerPart:
        """The owner part of a stack, made on its first step."""
        owner = self._owners.get(spec.index)
        if owner is None:
            owner = self._owners[spec.index] = self._owner_of(spec)
        return owner

    def stacks(
        self, stacks: Sequence[torch.Tensor], specs: Sequence[StackSpec]
    ) -> list[torch.Tensor]:
        """Newton–Schulz on each of a bucket's stacks (:meth:`__call__`). A step built for
        capture (``cuda_graph``) on CUDA spreads the launch-bound ones whose owner part may
        run ``beside`` the others over its stream and side streams (:func:`lanes`, by
        FLOPs): in the graph the lanes are parallel branches, so small stacks, whose chains
        of short kernels each leave most of the GPU idle, run at once. A step built eager
        runs them in order: it would pay the streams' synchronisation on the host."""
        costs = [self._beside_cost(x, spec) for x, spec in zip(stacks, specs, strict=True)]
        if sum(c is not None for c in costs) < 2:
            return [self(x, spec) for x, spec in zip(stacks, specs, strict=True)]
        lane = lanes(costs)
        step = torch.cuda.current_stream()
        sides = {k: side_stream(stacks[0].device, f"stacks beside {k}") for k in set(lane) - {0}}
        for side in sides.values():
            side.wait_stream(step)
        results: dict[int, torch.Tensor] = {}
        for index, (x, spec) in enumerate(zip(stacks, specs, strict=True)):
            if lane[index]:
                with torch.cuda.stream(sides[lane[index]]):
                    result = self(x, spec)
                # Made and read across streams: freed only once both are done with them.
                x.record_stream(sides[lane[index]])
                result.record_stream(step)
                results[index] = result
        for index, (x, spec) in enumerate(zip(stacks, specs, strict=True)):
            if lane[index] == 0:
                results[index] = self(x, spec)
        for side in sides.values():
            step.wait_stream(side)
        return [results[index] for index in range(len(stacks))]

    def _beside_cost(self, x: torch.Tensor, spec: StackSpec) -> float | None:
        """The Newton–Schulz FLOPs of a stack that may run on a side stream, else None."""
        if not (self._settings.cuda_graph and x.is_cuda and launch_bound(x)):
            return None
        if not self._owner(spec).beside:
            return None
        batch, rows, cols = spec.shape
        return batch * ns_cost(rows, cols, steps=1)

    @property
    def sums(self) -> torch.Tensor:
        """Per matrix of every stack, the fp32 sum of its last result: finite exactly when
        the result is."""
        return self._sums

    def __call__(self, stack: torch.Tensor, spec: StackSpec) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack by its recipe, with its owner part."""
        settings = self._settings
        mask_stack_(stack, self._dropped_of_stack[spec.index], settings.backend)
        recipe = spec.recipe
        if recipe is None:
            raise RuntimeError(f"muon_dist: stack {spec.index} has no recipe; this is a bug")
        owner = self._owner(spec)

        def orthogonalize(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(
                x,
                steps=recipe.iterations,
                coefficients=recipe.coefficients,
                dtype=settings.ns_dtype,
                backend=settings.backend,
                method=recipe.method,
                graphs=self.graphs,
                graphed=owner.graphed,
                captured=settings.cuda_graph is True,
            )

        def run(x: torch.Tensor, part: int | None = None) -> torch.Tensor:
            return owner.run(x, orthogonalize, part)

        try:
            result = run(stack) if recipe.parts is None else recipe.parts.orthogonalize(stack, run)
        except Exception as exc:  # raised by step() once the other ranks know
            self._failures.of_tensors(exc, self._tensors_of_stack[spec.index])
            self._sums_of_stack[spec.index].zero_()
            return stack.new_zeros(stack.shape, dtype=settings.ns_dtype)
        # One sum per matrix instead of an elementwise test: a sum is finite exactly when
        # every entry is, since Newton–Schulz entries are O(1) and cannot overflow it.
        matrix_sums(result, self._sums_of_stack[spec.index], settings.backend)
        return result
