"""Backend choice for Newton–Schulz: one entry point for the optimizer and for users."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon_dist.kernels.availability import triton_available
from muon_dist.kernels.coefficients import Coefficients, resolve_coefficients
from muon_dist.kernels.gram import (
    DEFAULT_RESTARTS,
    newton_schulz_gram_torch,
    validate_method,
    validate_restarts,
)
from muon_dist.kernels.graphs import GRAPH_MAX_BYTES, GraphCache
from muon_dist.kernels.torch_ns import DEFAULT_EPS, newton_schulz_torch
from muon_dist.kernels.triton_ns import (
    TRITON_DTYPES,
    newton_schulz_gram_triton,
    newton_schulz_triton,
)

BACKENDS = ("auto", "torch", "triton")


def validate_backend(backend: str) -> None:
    """Reject unknown names and a Triton request on a machine that cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(BACKENDS)}")
    if backend == "triton" and not triton_available():
        raise RuntimeError(
            "backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU "
            "tests), and this machine lacks one; use backend='auto' or backend='torch' here"
        )


# Standard Newton–Schulz FLOPs per iteration, batch·(4m²n + 2m³), above which the Triton
# kernels win: below it their per-launch host cost and too few 128-row tiles to fill the
# GPU outweigh the halved Gram products (the sweep is in benchmarks/README.md, "Thresholds
# in the code").
TRITON_MIN_FLOP_PER_STEP = 1.6e11


def prefer_triton(m: int, n: int, batch: int) -> bool:
    """Whether the Triton kernels should beat torch for ``batch`` CUDA matrices of m×n.

    The symmetric kernels halve the FLOPs of the two Gram products, which pays only once
    there is enough work per call: e.g. one 3072² or 4096² matrix, 32×768×2048 experts, but
    not one 2048×8192 or 1024×4096 matrix, nor 8×256×1024. The same rule holds for the Gram
    iteration. Retune the threshold from benchmarks/bench_kernels.py on other GPUs.
    """
    small, large = min(m, n), max(m, n)
    return batch * (4 * small * small * large + 2 * small**3) >= TRITON_MIN_FLOP_PER_STEP


def replays_from_graph(X: torch.Tensor, graphed: bool = False) -> bool:
    """Whether ``newton_schulz(X, backend="auto", graphs=...)`` replays from a cached graph:
    ``X`` is a CUDA stack outside any capture, and either ``graphed`` (any size) or
    launch-bound: below :data:`TRITON_MIN_FLOP_PER_STEP` (about 0.2 ms of matrix work an
    iteration, where launching its few dozen kernels one by one takes the host as long) and
    at most :data:`~muon_dist.kernels.graphs.GRAPH_MAX_BYTES` (a graph keeps about five
    stack-sized buffers)."""
    if not X.is_cuda or X.ndim < 2 or torch.cuda.is_current_stream_capturing():
        return False
    return graphed or launch_bound(X)


def launch_bound(X: torch.Tensor) -> bool:
    """Whether Newton–Schulz on the stack ``X`` is bound by launching its kernels rather
    than by their work: below :data:`TRITON_MIN_FLOP_PER_STEP` and at most
    :data:`~muon_dist.kernels.graphs.GRAPH_MAX_BYTES`."""
    small = X.numel() * X.element_size() <= GRAPH_MAX_BYTES
    return small and not prefer_triton(*_matrices(X))


def _matrices(X: torch.Tensor) -> tuple[int, int, int]:
    """A stack's matrix shape and how many matrices it holds: rows, cols, batch."""
    rows, cols = X.shape[-2:]
    return rows, cols, X.numel() // max(rows * cols, 1)


def auto_uses_triton(X: torch.Tensor, dtype: torch.dtype, from_graph: bool) -> bool:
    """Whether ``backend="auto"`` runs the stack ``X`` on the Triton kernels: where
    :func:`prefer_triton` says so, and for every stack of at most
    :data:`~muon_dist.kernels.graphs.GRAPH_MAX_BYTES` that runs ``from_graph`` (replayed,
    or captured by the caller). In a graph a launch costs the host nothing, and there the
    Triton kernels (fused epilogues, half the Gram tiles) beat torch's on small stacks too.
    The choice depends on the stack and the caller alone, so a captured step and its eager
    twin (whose small stacks replay from a cache) run the same kernels."""
    # Cheapest checks first: small matrices are launch-bound, so microseconds show there.
    if X.ndim < 2 or not X.is_cuda or dtype not in TRITON_DTYPES:
        return False
    graphed = from_graph and X.numel() * X.element_size() <= GRAPH_MAX_BYTES
    return (graphed or prefer_triton(*_matrices(X))) and triton_available()


# Long-to-short side ratio from which "auto" takes the Gram iteration for CUDA matrices:
# square matrices do more work in Gram form than in the standard one, and the crossover
# lies between 1.5 and 2 (benchmarks/README.md, "Thresholds in the code").
GRAM_MIN_ASPECT = 2.0


def prefer_gram(m: int, n: int) -> bool:
    """Whether the Gram iteration should beat the standard one for CUDA m×n matrices.

    Gram trades the standard path's ``m²n`` products per step for ``m³`` ones (m the short
    side) plus ``m²n`` ones at its start, restart and end, so it pays from an aspect ratio
    on, whatever the batch.
    """
    small, large = min(m, n), max(m, n)
    return small > 0 and large >= GRAM_MIN_ASPECT * small


def _auto_uses_gram(X: torch.Tensor, dtype: torch.dtype) -> bool:
    if X.ndim < 2 or not X.is_cuda or dtype not in TRITON_DTYPES:
        return False
    return prefer_gram(*X.shape[-2:])


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "quintic",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    method: str = "auto",
    gram_restarts: Sequence[int] = DEFAULT_RESTARTS,
    graphs: GraphCache | None = None,
    graphed: bool = False,
    captured: bool = False,
) -> torch.Tensor:
    """Orthogonalize a matrix or a batch of matrices (any leading dims); returns ``dtype``.

    ``backend``: "torch" runs the torch backend; "triton" the Triton kernels (CUDA tensors, or
    CPU tensors under TRITON_INTERPRET=1); "auto" takes Triton for CUDA tensors where
    ``prefer_triton`` says it is faster or the stack runs from a graph (a ``graphs`` cache,
    or ``captured``: the caller captures this call into a CUDA graph of its own) and is at
    most ``GRAPH_MAX_BYTES``, torch otherwise. ``method``: "standard" iterates on
    the matrix, "gram" on its short side's Gram matrix (:mod:`muon_dist.kernels.gram`),
    restarting before the steps in ``gram_restarts``; "auto" takes Gram for CUDA tensors
    where ``prefer_gram`` says it is faster (rectangular ones), standard otherwise. Under
    ``backend="auto"`` with a ``graphs`` cache, launch-bound CUDA stacks, and those of any
    size when ``graphed`` (a caller whose step is bound by the host), replay from a CUDA
    graph captured on their first call into that cache (:func:`replays_from_graph`,
    :mod:`muon_dist.kernels.graphs`): their time is launches.
    """
    validate_backend(backend)
    validate_method(method)
    restarts = validate_restarts(gram_restarts)
    gram = method == "gram" or (method == "auto" and _auto_uses_gram(X, dtype))
    from_graph = captured or graphs is not None
    triton = backend == "triton" or (backend == "auto" and auto_uses_triton(X, dtype, from_graph))

    def run(Z: torch.Tensor) -> torch.Tensor:
        if gram:
            run_gram = newton_schulz_gram_triton if triton else newton_schulz_gram_torch
            return run_gram(Z, steps, coefficients, eps, dtype, restarts)
        run_standard = newton_schulz_triton if triton else newton_schulz_torch
        return run_standard(Z, steps, coefficients, eps, dtype)

    if backend == "auto" and graphs is not None and replays_from_graph(X, graphed):
        schedule = resolve_coefficients(coefficients, steps)
        key = (tuple(X.shape), X.dtype, X.device, schedule, eps, dtype, gram, triton, restarts)
        return graphs.run(key, X, run)
    return run(X)
