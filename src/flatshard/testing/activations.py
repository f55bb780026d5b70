"""Counting the activation memory autograd keeps for backward (tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine import gathered_buffers, unit_states

__all__ = ["held_activation_bytes", "saved_activation_bytes"]


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


def held_activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``forward()`` and return (bytes of tensor storage it left alive, its result): what the forward holds for
    backward, whatever holds it.

    Unlike :func:`saved_activation_bytes`, this sees what selective activation checkpointing keeps (torch caches
    those outputs itself; autograd's saved-tensor hooks never see them) and what a checkpoint keeps of its inputs.
    Measured by the estimator's storage tracker (see [Note: what the memory tracker measures]); the parameters,
    buffers and ``model``'s gathered parameter buffers are not counted.
    """
    from flatshard.estimator.tracker import StorageTracker

    tracker = StorageTracker()
    tracker.watch([*model.parameters(), *model.buffers()])  # gradients: no forward operator touches them
    tracker.watch_resizable(gathered_buffers(model))
    with tracker:
        before = tracker.live() - tracker.resizable_bytes()
        result = forward()
        held = tracker.live() - tracker.resizable_bytes() - before
    return held, result
