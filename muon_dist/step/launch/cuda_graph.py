"""Capture of the whole optimizer step in one CUDA graph, and its replay.

A step of many small matrices is bound by the host: each kernel launch and collective
costs microseconds of Python and driver work. Replaying a captured graph launches the
same work with one call. What a replay cannot see, it must not depend on:

- the learning rates are staged into device memory before each replay, so schedulers
  keep working; any other change to a group (momentum, weight decay, betas, ...) makes
  the next step eager warm-up and capture again;
- the gradient tensors are read where they were at capture: they must persist between
  steps (``zero_grad(set_to_none=False)``), and a step whose gradients moved is refused;
- ``load_state_dict`` replaces state tensors, so it drops the graph too.

Warm-up steps run eagerly on the capture stream first, so that Triton autotuning, cuBLAS
workspaces and NCCL communicators exist before capture. A graph holding collectives keeps
them alive: drop the optimizer before ``dist.destroy_process_group()``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from muon_dist.kernels.streams import side_stream


class StepGraph:
    """Warm up ``warmup`` eager steps, capture the next one, then replay it."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None
        self._key: Hashable = None
        self._pointers: tuple[int, ...] = ()
        self._eager = 0

    def reset(self) -> None:
        """Forget the graph: the next steps warm up and capture again."""
        self._graph = None
        self._eager = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def run(
        self, body: Callable[[], None], key: Hashable, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Run one step: eagerly while warming up, else by replaying the captured graph."""
        pointers = tuple(0 if g is None else g.data_ptr() for g in grads)
        if key != self._key:
            self.reset()
            self._key = key
        if self._graph is not None and pointers != self._pointers:
            raise RuntimeError(
                "cuda_graph=True: the gradient tensors moved since the step was captured "
                "(zero_grad() frees them by default); call zero_grad(set_to_none=False) so "
                "the captured step reads this step's gradients, or use cuda_graph=False"
            )
        if self._graph is None and self._eager < self.warmup:
            if self._stream is None:
                self._stream = side_stream(torch.device("cuda"), "step warm-up")
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                body()
            torch.cuda.current_stream().wait_stream(self._stream)
            self._eager += 1
            return
        if self._graph is None:
            graph = torch.cuda.CUDAGraph()
            # "thread_local": the NCCL watchdog thread polls events while this thread
            # captures; "global" would fail the capture on its calls.
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                body()
            self._graph, self._pointers = graph, pointers
        self._graph.replay()
