"""Operands of a step's scalars (:func:`muon_dist.rules.ops.stage_scalars_`) for the tests
that hold its fused form to its torch form, on the CPU and on a GPU."""

import torch
from bits import assert_same_bits

from muon_dist.rules import ops


def scalar_operands(
    tensors: int,
    pieces: int,
    groups: int,
    classes: int,
    matrices: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], ops.ScalarLayout]:
    """A step's sources and layout on ``device``: random lrs and weight decays per group,
    tensors of random groups (some cautious), pieces, classes and stacked matrices of
    random tensors, and a keep mask with gaps."""
    g = torch.Generator().manual_seed(seed)

    def pick(n: int, high: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), generator=g)

    cautious = (torch.rand(tensors, generator=g) < 0.3).float()
    layout = ops.ScalarLayout(
        group_of=pick(tensors, groups),
        plain_mask=1.0 - cautious,
        cautious_mask=cautious,
        piece_tensor=pick(pieces, tensors),
        neg_scale=-torch.rand(pieces, generator=g) * 3,
        class_group=pick(classes, groups),
        class_neg_scale=-torch.rand(classes, generator=g) * 3,
        stack_tensor=pick(matrices, tensors),
    )
    sources = {
        "lr": torch.rand(groups, generator=g) * 0.03,
        "weight_decay": torch.rand(groups, generator=g) * 0.2,
        "keep": torch.rand(tensors, generator=g) < 0.8,
    }
    moved = {name: t.to(device) for name, t in sources.items()}
    return moved, ops.ScalarLayout(**{name: t.to(device) for name, t in vars(layout).items()})


def unwritten_scalars(
    tensors: int,
    pieces: int,
    groups: int,
    classes: int,
    matrices: int,
    device: torch.device | str = "cpu",
) -> ops.StepScalars:
    """Outputs on ``device`` filled with values no step writes, so a missed entry shows."""
    out = ops.StepScalars(
        keep=torch.zeros(tensors, dtype=torch.bool),
        decay=torch.full((tensors,), float("nan")),
        cautious=torch.full((tensors,), float("nan")),
        step=torch.full((pieces,), float("nan")),
        ok=torch.zeros((), dtype=torch.bool),
        group_decay=torch.full((groups,), float("nan")),
        class_step=torch.full((classes,), float("nan")),
        dropped=torch.ones(matrices, dtype=torch.bool),
    )
    return ops.StepScalars(**{name: t.to(device) for name, t in vars(out).items()})


def both_forms(
    sizes: tuple[int, int, int, int, int],
    found_inf: float,
    *,
    drop: bool,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], ops.ScalarLayout, ops.StepScalars, ops.StepScalars]:
    """A step's scalars staged by the torch form and by the fused form from the same
    operands (:func:`scalar_operands` of ``sizes``): sources, layout, torch's, fused."""
    sources, layout = scalar_operands(*sizes, seed=seed, device=device)
    found = torch.tensor(found_inf, device=device)
    torch_form, fused_form = unwritten_scalars(*sizes, device), unwritten_scalars(*sizes, device)
    for out, fused in ((torch_form, False), (fused_form, True)):
        ops.stage_scalars_(
            sources["lr"],
            sources["weight_decay"],
            sources["keep"],
            found,
            layout,
            out,
            drop=drop,
            fused=fused,
        )
    return sources, layout, torch_form, fused_form


def assert_bitwise_equal(expected: ops.StepScalars, got: ops.StepScalars) -> None:
    """Every output of ``got`` has ``expected``'s dtype and bits (-0.0 is not 0.0)."""
    for name, want in vars(expected).items():
        assert_same_bits(getattr(got, name), want, name)
