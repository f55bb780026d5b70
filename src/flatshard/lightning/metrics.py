"""torchmetrics states on the strategy's device: they are plain attributes, never sharded."""

from __future__ import annotations

import torch
from torch.nn import Module

__all__ = ["move_metrics"]


def move_metrics(model: Module, device: torch.device) -> None:
    """torchmetrics states are plain attributes, not buffers: move them like Lightning does (never sharded)."""
    from torchmetrics import Metric

    for m in model.modules():
        if isinstance(m, Metric):
            states = [v for v in vars(m).get("_defaults", {}).values() if isinstance(v, torch.Tensor)]
            if any(t.is_meta for t in states):
                raise ValueError(
                    f"The torchmetrics {type(m).__name__} was created on the meta device (inside "
                    "init_module(empty_init=True) or torch.device('meta')), so its states have no values. HINT: "
                    "create metrics outside that context, e.g. assign them after it or in setup()."
                )
            m.to(device)
