"""Replay Newton–Schulz calls from cached CUDA graphs; the one way the library captures.

A small stack (one 1024×4096 matrix) is bound by the host launching its ~30 kernels one by
one, longer than the GPU takes to run them. Replaying a graph captured on the first call
costs one copy in, one launch and one copy out. Only ``backend="auto"`` uses this, for the
stacks :func:`muon_dist.kernels.dispatch.replays_from_graph` finds launch-bound (at most
:data:`GRAPH_MAX_BYTES`), and for larger ones whose caller knows its step is bound by the
host (``graphed=True``: Dion2's selected slices, a quarter of each stack, where the step's
other host work already exceeds the GPU's). A call made while a graph is being captured (a
user capturing the whole optimizer step) runs eagerly, since that capture already removes
the launches.

The graphs and their memory belong to a :class:`GraphCache`, which the caller owns (an
optimizer's step owns one): they are freed with it, never kept by the process. Every
capture, these and the step's own graph, goes through :func:`capturing`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from muon_dist.kernels.streams import side_stream

# The largest launch-bound stack that replays from a graph (eight 3072×768 bf16 matrices are
# 36 MiB). Each cached graph keeps its intermediates (a few stack-sized buffers) in a
# private pool.
GRAPH_MAX_BYTES = 64 * 2**20
# Graphs kept per cache, the first shapes seen. Each holds its input, output and
# intermediates, about five times its input's bytes: for launch-bound stacks at most
# MAX_GRAPHS · 5 · GRAPH_MAX_BYTES; a graphed larger stack adds five times its own size.
MAX_GRAPHS = 16


@dataclass
class _Graphed:
    static_input: torch.Tensor
    static_output: torch.Tensor
    graph: torch.cuda.CUDAGraph


class GraphCache:
    """Captured graphs by key, at most ``capacity``; dropping the cache frees them."""

    def __init__(self, capacity: int = MAX_GRAPHS) -> None:
        self.capacity = capacity
        self._graphs: dict[Hashable, _Graphed] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self, key: Hashable, X: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn(X)`` replayed from the graph cached under ``key`` (which must name everything
        besides X's values that ``fn`` depends on: shape, dtype, device, options).

        The first call per key warms ``fn`` up on a side stream (cuBLAS and Triton set
        themselves up, Triton autotunes) and captures it, while the cache has room; a key
        that finds it full runs ``fn`` eagerly (a capture synchronises: a cycling cache
        would do it every step). The result is always a fresh tensor, never the graph's
        static output.
        """
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.capacity:
                return fn(X)
            entry = _capture(X, fn)
            self._graphs[key] = entry
        entry.static_input.copy_(X)
        entry.graph.replay()
        return entry.static_output.clone()


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None
) -> Iterator[None]:
    """``torch.cuda.graph`` in "thread_local" mode (other threads, such as NCCL's watchdog,
    may call CUDA meanwhile), with Python's cyclic garbage collector paused.

    A collection during a capture can finalize garbage whose destructor calls the CUDA
    driver (a dropped Triton kernel unloads its module), which invalidates the capture; torch
    collects before capturing only under ``torch.compiler.config.force_cudagraph_gc``.
    The garbage waits for the next collection after the capture instead.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


def _capture(X: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> _Graphed:
    with torch.cuda.device(X.device):
        static_input = X.clone(memory_format=torch.contiguous_format)
        side = side_stream(X.device, "graph capture")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(static_input)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            static_output = fn(static_input)
    return _Graphed(static_input, static_output, graph)
