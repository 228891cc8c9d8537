"""The owner's work on a stack of whole matrices: Newton–Schulz by the stack's recipe, with
the rule's own part (NorMuon's row normalization, Dion2's chosen slices), and a device flag
per matrix of whether its result is finite."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.kernels.dispatch import newton_schulz
from muon_dist.kernels.graphs import GraphCache
from muon_dist.options.settings import ExecutionSettings
from muon_dist.plan.bucket_map import StackSpec
from muon_dist.plan.indices import TensorIndex
from muon_dist.rules.ops import mask_stack_
from muon_dist.rules.registry import RULES
from muon_dist.rules.slices import selected_orthogonalize
from muon_dist.state.row_moments import RowMoments
from muon_dist.step.failures import Failures


class Orthogonalizer:
    """Newton–Schulz on every stack of a plan. ``stack_tensor`` lists, per matrix of every
    stack in plan order, its Muon tensor; ``dropped`` (the same layout) marks the matrices a
    step drops. The sum of each matrix's result is kept (finite exactly when the result is),
    so a step tests every result at once instead of once per stack."""

    def __init__(
        self,
        settings: ExecutionSettings,
        row_moments: RowMoments,
        failures: Failures,
        stack_tensor: Sequence[TensorIndex],
        stack_sizes: Sequence[int],
        dropped: torch.Tensor,
    ) -> None:
        self._settings = settings
        self._row_moments = row_moments
        self._failures = failures
        self.stack_tensor = torch.tensor(
            list(stack_tensor), dtype=torch.long, device=dropped.device
        )
        self._tensors_of_stack = self.stack_tensor.split_with_sizes(list(stack_sizes))
        self._sums = torch.zeros(len(stack_tensor), device=dropped.device)
        self._sums_of_stack = self._sums.split_with_sizes(list(stack_sizes))
        self._dropped_of_stack = dropped.split_with_sizes(list(stack_sizes))
        self.graphs = GraphCache()  # freed with this step (the optimizer)

    def finite(self) -> torch.Tensor:
        """Per matrix of every stack: whether its last result was finite (a new tensor)."""
        return torch.isfinite(self._sums)

    def __call__(
        self, stack: torch.Tensor, spec: StackSpec, chosen: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Newton–Schulz on a ``[k, rows, cols]`` stack by its recipe; for a Dion2 stack on
        the ``chosen`` slices of each matrix (per part, ``[matrices, count]``)."""
        settings = self._settings
        mask_stack_(stack, self._dropped_of_stack[spec.index], settings.backend)
        recipe = spec.recipe
        if recipe is None:
            raise RuntimeError(f"muon_dist: stack {spec.index} has no recipe; this is a bug")
        rows = self._row_moments.stacks.get(spec.index)
        selected = recipe.rule if RULES[recipe.rule.name].selects_slices else None

        def orthogonalize(x: torch.Tensor) -> torch.Tensor:
            # Dion2's stacks, a share of the slices, replay from graphs whatever their size:
            # launching their Newton–Schulz costs the host more than the GPU's work.
            return newton_schulz(
                x,
                steps=recipe.iterations,
                coefficients=recipe.coefficients,
                dtype=settings.ns_dtype,
                backend=settings.backend,
                method=recipe.method,
                graphs=self.graphs,
                graphed=selected is not None,
            )

        def run(x: torch.Tensor, part: int | None = None) -> torch.Tensor:
            if selected is not None and selected.fraction is not None:
                # A part is handed over by output rows, whatever the storage.
                transposed = bool(selected.transposed) and part is None
                index = None if chosen is None else chosen[part or 0]
                return selected_orthogonalize(
                    x, orthogonalize, selected.fraction, transposed, settings.backend, index
                )
            result = orthogonalize(x)
            return result if rows is None else self._row_moments.normalize(result, rows, part)

        try:
            result = run(stack) if recipe.parts is None else recipe.parts.orthogonalize(stack, run)
        except Exception as exc:  # raised by step() once the other ranks know
            self._failures.of_tensors(exc, self._tensors_of_stack[spec.index])
            self._sums_of_stack[spec.index].zero_()
            return stack.new_zeros(stack.shape, dtype=settings.ns_dtype)
        # One sum per matrix instead of an elementwise test: a sum is finite exactly when
        # every entry is, since Newton–Schulz entries are O(1) and cannot overflow it.
        torch.sum(result, dim=(-2, -1), dtype=torch.float32, out=self._sums_of_stack[spec.index])
        return result
