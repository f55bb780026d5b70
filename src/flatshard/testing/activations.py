"""Counting the activation memory autograd keeps for backward (tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine import unit_states

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``forward()`` and return (bytes of the distinct storages autograd saved, its result).

    The gathered parameter buffers of ``model``'s units are not counted. Every packed tensor is held until
    the end, so no storage is freed and its address reused while counting.
    """
    params = {h._gather.untyped_storage()._cdata for s in unit_states(model) for h in s.handles}
    held: list[torch.Tensor] = []
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            held.append(t)
            sizes[storage._cdata] = max(sizes.get(storage._cdata, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    return sum(sizes.values()), result
