"""The AdamW phase of a step: torch's fused AdamW on every AdamW group, after the Muon
phase, reading the step's agreement on the device.

Every rank launches the same kernels whatever its gradients: a parameter without a local
gradient takes a zero one where another rank has a gradient (as a Muon parameter does), so
replicas and step counts stay equal, and the launch is skipped on the device where no rank
has one or the step is not kept (``found_inf``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.optim.adamw import adamw as adamw_update

from muon_dist.state.tensors import local
from muon_dist.step.agree.agreement import Agreement
from muon_dist.step.shard.scalars import StepInputs


class AdamWPhase:
    """Fused AdamW for the parameters at ``members[g]`` (positions among all parameters)
    of each AdamW group ``g``, bound to their state tensors by :meth:`bind_state`."""

    def __init__(
        self,
        members: dict[int, list[int]],
        params: Sequence[torch.Tensor],
        inputs: StepInputs,
        agreement: Agreement,
    ) -> None:
        self.members = members
        self._params = params
        self._inputs = inputs
        self._agreement = agreement
        self._cuda = inputs.buffer.device.type == "cuda"
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] = {}
        self._strided: set[int] = set()

    def bind_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Point at the state tensors (again after a state load, which replaces them)."""
        self._tensors = {
            i: (
                local(p),
                local(state[p]["exp_avg"]),
                local(state[p]["exp_avg_sq"]),
                state[p]["step"],
            )
            for members in self.members.values()
            for i in members
            for p in (self._params[i],)
        }
        # Parameters that are strided views (a slice, a transpose): the fused kernel reads a
        # parameter and its moments as one dense layout, so they take contiguous copies.
        self._strided = {
            i
            for i, tensors in self._tensors.items()
            if not all(t.is_contiguous() for t in tensors[:3])
        }

    def run(self, groups: Sequence[dict[str, Any]], grads: Sequence[torch.Tensor | None]) -> None:
        """AdamW for every AdamW group of ``groups``."""
        for index in self.members:
            self._group(groups[index], index, grads)

    def _group(
        self, group: dict[str, Any], index: int, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """One group: one launch for its parameters with a local gradient, one per
        parameter without (a zero gradient, skipped where no rank has one)."""
        agreement = self._agreement
        members = self.members[index]
        present = [i for i in members if grads[i] is not None]
        if present:
            self._launch(group, index, present, grads, agreement.found_inf)
        for i in members:
            if grads[i] is None:
                skip = torch.maximum(agreement.found_inf, 1.0 - agreement.present[i])
                zero = torch.zeros_like(self._tensors[i][0])
                self._launch(group, index, [i], {i: zero}, skip)

    def _launch(
        self,
        group: dict[str, Any],
        index: int,
        members: Sequence[int],
        grads: Sequence[torch.Tensor | None] | dict[int, torch.Tensor],
        found_inf: torch.Tensor,
    ) -> None:
        tensors = self._tensors
        beta1, beta2 = group["betas"]
        params = [tensors[i][0] for i in members]
        grad_list = [cast(torch.Tensor, grads[i]) for i in members]
        exp_avgs = [tensors[i][1] for i in members]
        exp_avg_sqs = [tensors[i][2] for i in members]
        # A strided parameter (or gradient) is updated in contiguous copies, written back
        # after the update (unchanged where the step skips it).
        moved = [
            k
            for k, i in enumerate(members)
            if i in self._strided or not grad_list[k].is_contiguous()
        ]
        originals = [(params[k], exp_avgs[k], exp_avg_sqs[k]) for k in moved]
        for k in moved:
            params[k], grad_list[k], exp_avgs[k], exp_avg_sqs[k] = (
                x.contiguous() for x in (params[k], grad_list[k], exp_avgs[k], exp_avg_sqs[k])
            )
        adamw_update(
            params,
            grad_list,
            exp_avgs,
            exp_avg_sqs,
            [],
            [tensors[i][3] for i in members],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            # AdamW reads its lr from device memory on CUDA (fused AdamW takes a tensor lr).
            lr=self._inputs.lr_of_group[index] if self._cuda else group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            found_inf=found_inf,
        )
        for k, (param, exp_avg, exp_avg_sq) in zip(moved, originals, strict=True):
            param.copy_(params[k])
            exp_avg.copy_(exp_avgs[k])
            exp_avg_sq.copy_(exp_avg_sqs[k])
