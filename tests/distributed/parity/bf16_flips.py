"""How far one bf16 rounding of one Newton–Schulz input entry moves a matrix's update, per
group of the parity cases (parity_cases.BF16_FLIP holds the result): the reference's
momentum and Newton–Schulz input for each step of a case, each entry in turn moved to its
other bf16 neighbour, Newton–Schulz in fp32 on both inputs (so only the flip differs)."""

from __future__ import annotations

import torch
from parity_cases import MUON_SETS, STEPS, Case

from muon_dist.kernels.dispatch import newton_schulz

_U = 2.0**-8  # bf16's unit roundoff


def _other_neighbour(x: torch.Tensor) -> torch.Tensor:
    """``x`` (bf16) moved one bf16 step away from zero, or toward it where that is the same."""
    up = (x.float() * (1 + _U)).to(torch.bfloat16)
    return torch.where(up == x, (x.float() * (1 + 2 * _U)).to(torch.bfloat16), up)


def worst_flips(case: Case, seed: int = 1234) -> dict[str, float]:
    """Per group of ``case``'s Muon parameters (3-D expert stacks), the largest norm-wise
    change of one matrix's orthogonalized update from one flipped input entry."""
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s.shape, generator=gen) for s in case.params]
    grads = [[torch.randn(s.shape, generator=gen) for s in case.params] for _ in range(STEPS)]
    worst: dict[str, float] = {}
    for index, spec in enumerate(case.params):
        sets = MUON_SETS[spec.group]
        beta, nesterov = sets["momentum"], sets.get("nesterov", True)
        method = "gram" if sets.get("ns_method") == "gram" else "standard"

        def orthogonalize(x: torch.Tensor, sets: dict = sets, method: str = method) -> torch.Tensor:
            return newton_schulz(
                x.float(),
                coefficients=sets.get("coefficients", "quintic"),
                dtype=torch.float32,
                backend="torch",
                method=method,
            )

        momentum = torch.zeros_like(fulls[index])
        for step_grads in grads:
            grad = step_grads[index]
            momentum = grad + beta * momentum
            x = ((grad + beta * momentum) if nesterov else momentum).to(torch.bfloat16)
            flipped = _other_neighbour(x)
            for e in range(x.shape[0]):
                base = orthogonalize(x[e])
                for r, c in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[1:])).tolist():
                    y = x[e].clone()
                    y[r, c] = flipped[e, r, c]
                    change = (orthogonalize(y) - base).norm() / base.norm()
                    worst[spec.group] = max(worst.get(spec.group, 0.0), change.item())
    return worst
