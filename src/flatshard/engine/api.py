"""Public state functions: ``get_state_dict`` / ``set_state_dict`` over model and optimizer(s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.optim_state import convert_full_optim_state_dict, full_optim_state_dict
from flatshard.engine.state_dict import (
    check_full_model_state_dict,
    full_model_state_dict,
    load_full_model_state_dict,
)

__all__ = ["get_state_dict", "set_state_dict"]

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _not_sharded_yet() -> NotImplementedError:
    return NotImplementedError(
        "full=False (sharded state) is not available in this flatshard release yet (the checkpoints issue). "
        "HINT: use full=True."
    )


def get_state_dict(
    module: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    full: bool = True,
    rank0_only: bool = True,
    cpu_offload: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Return ``(model_state, optimizer_state)``; call it on every rank.

    Args:
        module: a module sharded with ``flatshard.shard``.
        optimizer: an optimizer, a list of optimizers, or ``None``. The optimizer state is then the plain
            format (a list for a list), or ``None``.
        full: gather full, consolidated state (the only mode in this release). Default: ``True``.
        rank0_only: only global rank 0 receives the state; other ranks get empty dicts. Default: ``True``.
        cpu_offload: copy the gathered tensors to CPU. Default: ``True``.
    """
    if not full:
        raise _not_sharded_yet()
    model_state = full_model_state_dict(module, rank0_only=rank0_only, cpu_offload=cpu_offload)
    if optimizer is None:
        return model_state, None
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    states = [
        full_optim_state_dict(module, o, rank0_only=rank0_only, cpu_offload=cpu_offload) for o in optimizers
    ]
    return model_state, states[0] if isinstance(optimizer, torch.optim.Optimizer) else states


def set_state_dict(
    module: nn.Module,
    optimizer: OptimizerArg,
    model_state: Mapping[str, Any] | None,
    optimizer_state: Any = None,
    *,
    full: bool = True,
    strict: bool = True,
) -> None:
    """Load full model and optimizer state on every rank (each rank keeps only its slices).

    Args:
        module: a module sharded with ``flatshard.shard``.
        optimizer: the optimizer(s) matching ``optimizer_state``, or ``None``.
        model_state: a full state dict (``None`` to skip the model).
        optimizer_state: plain-format optimizer state (a list for several optimizers), or ``None``.
        full: the state is full (the only mode in this release). Default: ``True``.
        strict: refuse missing or unexpected model keys. Default: ``True``.
    """
    if not full:
        raise _not_sharded_yet()
    optimizers: list[torch.optim.Optimizer] = []
    states: list[Any] = []
    if optimizer is not None and optimizer_state is not None:
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        states = [optimizer_state] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer_state)
        if len(states) != len(optimizers):
            raise ValueError(f"Got {len(optimizers)} optimizers but {len(states)} optimizer states.")
    # Validate everything before changing anything.
    if model_state is not None:
        check_full_model_state_dict(module, model_state, strict=strict)
    local = [
        convert_full_optim_state_dict(module, opt, st, source=f"optimizer state #{i}")
        for i, (opt, st) in enumerate(zip(optimizers, states))
    ]
    if model_state is not None:
        load_full_model_state_dict(module, model_state, strict=strict)
    for opt, st in zip(optimizers, local):
        opt.load_state_dict(st)
