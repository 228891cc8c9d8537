"""muon_dist.Muon as torchtitan's optimizer: one Muon per model part, torchtitan's checkpoints.

torchtitan builds its optimizer from ``config.optimizer`` with ``model_parts`` (one per
pipeline stage on this rank) and saves it through ``OptimizersContainer.state_dict()``, a
flat dict keyed by parameter names that DCP reshards. :class:`MuonOptimizersContainer` keeps
that contract and builds, per model part, ``muon_dist.Muon(muon_dist.param_groups(part))``;
each part's Muon runs its collectives among the ranks holding that part (its data-parallel
mesh), so pipeline stages never meet in a collective::

    from muon_dist.integrations.torchtitan import MuonOptimizersContainer

    config.optimizer = MuonOptimizersContainer.Config(
        lr=0.02, adamw_lr=3e-4, weight_decay=0.1, muon_options={"comm_dtype": torch.bfloat16}
    )

Needs ``torchtitan`` (0.3); torchtitan's LR schedulers drive the ``lr`` of both kinds of
group, since each Muon is a torch optimizer with real param groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

import muon_dist


class MuonOptimizersContainer(OptimizersContainer):  # type: ignore[misc]  # untyped base
    """torchtitan's optimizer container holding one :class:`muon_dist.Muon` per model part."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):  # type: ignore[misc]  # untyped base
        lr: float = 0.02
        """Muon lr of hidden matrices."""
        adamw_lr: float = 3e-4
        """AdamW lr of embeddings, the head, norms and biases."""
        weight_decay: float = 0.1
        """Decoupled weight decay of Muon matrices, embeddings and the head (never of
        norms and biases)."""
        momentum: float = 0.95
        routing: dict[str, Any] = field(default_factory=dict)
        """Extra arguments of :func:`muon_dist.param_groups` (``fused``, ``overrides``,
        ``num_experts``, ...)."""
        muon_options: dict[str, Any] = field(default_factory=dict)
        """Extra arguments of :class:`muon_dist.Muon` (``comm_dtype``, ``magma``, ...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError(
                "MuonOptimizersContainer routes parameters with muon_dist.param_groups; "
                f"leave param_groups empty (got {len(config.param_groups)} entries) and pass "
                "its options as routing={...}"
            )
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        for part in model_parts:
            groups = muon_dist.param_groups(
                part, weight_decay=config.weight_decay, **config.routing
            )
            optimizer = muon_dist.Muon(
                groups,
                lr=config.lr,
                adamw_lr=config.adamw_lr,
                momentum=config.momentum,
                **config.muon_options,
            )
            self.optimizers.append(optimizer)
            all_params += [p for group in groups for p in group["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)
