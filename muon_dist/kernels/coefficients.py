"""Newton–Schulz coefficient schedules: named public sets and user-supplied lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Coefficients = str | Sequence[Sequence[float]]


@dataclass(frozen=True)
class CoefficientSchedule:
    """Per-iteration (a, b, c) triples plus the factor the Frobenius norm is inflated by.

    Polar Express is tuned for inputs whose spectral norm is at most 1/1.02, so it divides by
    ``1.02 * ||X||_F`` instead of ``||X||_F``; the other sets use 1.
    """

    steps: tuple[tuple[float, float, float], ...]
    norm_scale: float = 1.0


_KELLER = (3.4445, -4.7750, 2.0315)
_QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

COEFFICIENT_SETS: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = {
    "keller": ((_KELLER,), 1.0),
    "quintic": (_QUINTIC, 1.0),
    "polar_express": (_POLAR_EXPRESS, 1.02),
}


def resolve_coefficients(coefficients: Coefficients, steps: int) -> CoefficientSchedule:
    """Expand a set name or an explicit list into exactly ``steps`` triples.

    Schedules shorter than ``steps`` repeat their last triple, which is the converged
    iteration each public schedule ends on; longer ones are truncated.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be a positive integer, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"coefficients={coefficients!r} is not a known set; choose one of "
                f"{sorted(COEFFICIENT_SETS)} or pass a list of (a, b, c) triples"
            )
        base, norm_scale = COEFFICIENT_SETS[coefficients]
    else:
        base = _validate_triples(coefficients)
        norm_scale = 1.0
    expanded = tuple(base[min(k, len(base) - 1)] for k in range(steps))
    return CoefficientSchedule(steps=expanded, norm_scale=norm_scale)


def _validate_triples(
    coefficients: Sequence[Sequence[float]],
) -> tuple[tuple[float, float, float], ...]:
    message = f"coefficients={coefficients!r} must be a set name or a non-empty list of (a, b, c)"
    triples: list[tuple[float, float, float]] = []
    try:
        for triple in coefficients:
            a, b, c = (float(v) for v in triple)
            triples.append((a, b, c))
    except (TypeError, ValueError) as exc:
        raise ValueError(message) from exc
    if not triples:
        raise ValueError(message)
    return tuple(triples)
