"""Newton–Schulz orthogonalization: coefficient sets, torch and Triton backends."""

from muon_dist.kernels.coefficients import (
    COEFFICIENT_SETS,
    CoefficientSchedule,
    resolve_coefficients,
)
from muon_dist.kernels.dispatch import BACKENDS, newton_schulz
from muon_dist.kernels.torch_ns import newton_schulz_torch

__all__ = [
    "BACKENDS",
    "COEFFICIENT_SETS",
    "CoefficientSchedule",
    "newton_schulz",
    "newton_schulz_torch",
    "resolve_coefficients",
]
