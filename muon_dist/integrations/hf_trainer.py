"""muon_dist.Muon under transformers' ``Trainer``, routed by the model's structure.

``Trainer.create_optimizer`` (transformers 5.23) passes an optimizer class only its own two
groups of bare parameters (decay / no decay: no names, no algorithm), so
``optimizer_cls_and_kwargs=(muon_dist.Muon, {...})`` cannot tell an embedding from a hidden
matrix. A class that is not a ``torch.optim.Optimizer`` is treated as a factory instead:
the Trainer calls ``cls()(model, **kwargs)``, which is what :class:`MuonFactory` takes::

    from muon_dist.integrations.hf_trainer import MuonFactory

    trainer = Trainer(
        model=model,
        args=args,
        optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "adamw_lr": 3e-4}),
    )

``kwargs`` holds :class:`muon_dist.Muon`'s arguments and :func:`muon_dist.param_groups`'
routing arguments (``overrides``, ``fused``, ``conv``, ...), told apart by name.
``Trainer(optimizers=(muon_dist.Muon(muon_dist.param_groups(model)), None))`` works too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import muon_dist
from muon_dist.routing.arguments import ARGUMENT_KEYS
from muon_dist.routing.param_groups import param_groups

# param_groups' keyword arguments that only routing reads (the hyper-parameters go to Muon).
_ROUTING = frozenset((*ARGUMENT_KEYS, "report"))


class MuonFactory:
    """``MuonFactory()(model, **kwargs)``: ``Muon(param_groups(model, **routing), **rest)``."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> muon_dist.Muon:
        routing = {k: kwargs.pop(k) for k in list(kwargs) if k in _ROUTING}
        return muon_dist.Muon(param_groups(model, **routing), **kwargs)
