"""How the optimizer executes a step, as opposed to what it computes (the param groups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muon_dist.kernels.dispatch import validate_backend
from muon_dist.plan import REPLICA_MODES
from muon_dist.validation import count

NONFINITE_POLICIES = ("raise", "skip_step")
OVERLAP_MODES = ("none", "backward")


@dataclass(frozen=True)
class ExecutionSettings:
    """Execution settings shared by every group; validated on construction.

    ``backend`` picks the Newton–Schulz kernels and the form of the update rule's passes;
    ``comm_dtype`` and ``ns_dtype`` the dtypes of the exchanged pieces and of
    Newton–Schulz; ``bucket_bytes`` and ``max_inflight`` the size and overlap of the
    pipelined buckets; ``replica_mode`` how replicated matrices are shared out;
    ``nonfinite`` what a non-finite gradient or result does; ``cuda_graph`` whether the
    step is captured and replayed as one CUDA graph after ``graph_warmup`` eager steps;
    ``overlap="backward"`` starts the buckets from gradient hooks during backward
    (:mod:`muon_dist.backward_start`).
    """

    backend: str = "auto"
    comm_dtype: torch.dtype = torch.bfloat16
    ns_dtype: torch.dtype = torch.bfloat16
    bucket_bytes: int = 128 * 2**20
    max_inflight: int = 3
    replica_mode: str = "split"
    nonfinite: str = "raise"
    cuda_graph: bool = False
    graph_warmup: int = 2
    overlap: str = "none"

    def __post_init__(self) -> None:
        validate_backend(self.backend)
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite={self.nonfinite!r}; choose one of {list(NONFINITE_POLICIES)}"
            )
        for key, value in (("comm_dtype", self.comm_dtype), ("ns_dtype", self.ns_dtype)):
            if value not in (torch.bfloat16, torch.float32):
                raise ValueError(f"{key}={value}; choose torch.bfloat16 or torch.float32")
        if self.replica_mode not in REPLICA_MODES:
            raise ValueError(
                f"replica_mode={self.replica_mode!r}; choose one of {list(REPLICA_MODES)}"
            )
        count("Muon", "bucket_bytes", self.bucket_bytes, 1)
        count("Muon", "max_inflight", self.max_inflight, 1)
        count("Muon", "graph_warmup", self.graph_warmup, 1)
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"Muon: cuda_graph={self.cuda_graph!r}; choose True or False")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"Muon: overlap={self.overlap!r}; choose one of {list(OVERLAP_MODES)}")
        if self.overlap == "backward" and self.cuda_graph:
            raise ValueError(
                "Muon: overlap='backward' starts Newton-Schulz from gradient hooks during "
                "backward, outside any captured step; use cuda_graph=False with it, or "
                "overlap='none' to capture the step"
            )
