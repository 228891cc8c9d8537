"""How the optimizer executes a step, as opposed to what it computes (the param groups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muon_dist.options.schema import SETTINGS

_DEFAULT = {o.key: o.default for o in SETTINGS}

# The overlap settings under which a step may start from gradient hooks during backward.
STARTS_IN_BACKWARD = ("backward", "auto")


@dataclass(frozen=True)
class ExecutionSettings:
    """Execution settings shared by every group; validated on construction.

    ``backend`` picks the Newton–Schulz kernels and the form of the update rule's passes;
    ``comm_dtype`` and ``ns_dtype`` the dtypes of the exchanged pieces and of
    Newton–Schulz; ``bucket_bytes`` and ``max_inflight`` the size and overlap of the
    pipelined buckets; ``replica_mode`` how replicated matrices are shared out;
    ``nonfinite`` what a non-finite gradient or result does; ``cuda_graph`` whether the
    step is captured and replayed as one CUDA graph after ``graph_warmup`` eager steps
    (``"auto"``: where the job allows, :func:`muon_dist.step.launch.cuda_graph.capture_blocker`);
    ``overlap="backward"`` starts the buckets from gradient hooks during backward
    (:mod:`muon_dist.step.launch.backward`), ``"auto"`` times both modes and keeps the faster
    (:mod:`muon_dist.step.launch.overlap_choice`).
    """

    backend: str = _DEFAULT["backend"]
    comm_dtype: torch.dtype = _DEFAULT["comm_dtype"]
    ns_dtype: torch.dtype = _DEFAULT["ns_dtype"]
    bucket_bytes: int = _DEFAULT["bucket_bytes"]
    max_inflight: int = _DEFAULT["max_inflight"]
    replica_mode: str = _DEFAULT["replica_mode"]
    nonfinite: str = _DEFAULT["nonfinite"]
    cuda_graph: bool | str = _DEFAULT["cuda_graph"]
    graph_warmup: int = _DEFAULT["graph_warmup"]
    overlap: str = _DEFAULT["overlap"]

    def __post_init__(self) -> None:
        for option in SETTINGS:
            if option.check is not None:
                option.check("Muon", option.key, getattr(self, option.key))
        if self.starts_in_backward and self.cuda_graph is True:
            raise ValueError(
                f"Muon: overlap={self.overlap!r} starts Newton-Schulz from gradient hooks "
                "during backward (under 'auto', in the steps it times or chooses that way), "
                "outside any captured step; use cuda_graph='auto' (the default: eager there) or "
                "False with it, or overlap='none' to capture the step"
            )

    @property
    def starts_in_backward(self) -> bool:
        """Whether a step may start from gradient hooks: Muon parameters get hooks, and the
        plan orders buckets as backward finishes their gradients."""
        return self.overlap in STARTS_IN_BACKWARD
