"""The owner's work on a stack of whole matrices: Newton–Schulz by the stack's recipe, with
the owner part of the stack's rule (its wing's, :mod:`muon_dist.step.wings`), and a device
flag per matrix of whether its result is finite."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from muon_dist.kernels.dispatch import newton_schulz
from muon_dist.kernels.graphs import GraphCache
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import StackSpec
from muon_dist.plan.indices import TensorIndex
from muon_dist.rules.ops import mask_stack_, matrix_sums
from muon_dist.step.agree.failures import Failures


class OwnerPart:
    """What an owner does around Newton–Schulz on a stack; this class is Muon's: Newton–Schulz
    of the input as it is. ``graphed``: whether its Newton–Schulz replays from CUDA graphs
    whatever the stack's size."""

    graphed = False

    def run(
        self,
        x: torch.Tensor,
        orthogonalize: Callable[[torch.Tensor], torch.Tensor],
        part: int | None,
    ) -> torch.Tensor:
        """The owner's result for ``x`` (a stack, or one part of its matrices: ``part``)."""
        return orthogonalize(x)


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

    def finite(self) -> torch.Tensor:
        """Per matrix of every stack: whether its last result was finite (a new tensor)."""
        return torch.isfinite(self._sums)

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
