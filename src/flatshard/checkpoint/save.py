"""``save_checkpoint``: a sharded module (and optimizers) to one full file or a sharded directory."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from flatshard.checkpoint.stream_save import ModelState, OptimizerState, save_full_streamed
from flatshard.checkpoint.write_sharded import write_sharded_checkpoint
from flatshard.engine import (
    optimizer_list,
    sharded_model_state_dict,
    sharded_optim_state_dict,
)

__all__ = ["StateDictType", "save_checkpoint"]

StateDictType = Literal["full", "sharded"]


def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    state_dict_type: StateDictType = "full",
    extra: Mapping[str, Any] | None = None,
) -> Path | str:
    """Save ``module`` (and optimizers) to ``path``; call it on every rank. Returns the path (for a URL, the URL).

    Args:
        path: a file (``"full"``) or a directory (``"sharded"``): a local path or an fsspec URL (``s3://...``;
            see docs/checkpoints.md, "Remote storage").
        module: a module sharded with ``flatshard.shard``.
        optimizer: an optimizer, a list of them, or ``None``.
        state_dict_type: ``"full"`` (one consolidated file from rank 0) or ``"sharded"`` (every rank writes
            its pieces; no gathering).
        extra: more entries for the checkpoint dict (epoch, scheduler state...); loaded back by
            :func:`load_checkpoint`.
    """
    checkpoint = dict(extra or {})
    optimizers = optimizer_list(optimizer)
    if state_dict_type == "full":  # written as the units are gathered: see [Note: streamed full saves]
        checkpoint["state_dict"] = ModelState(module)
        if optimizers:
            checkpoint["optimizer_states"] = [OptimizerState(module, o) for o in optimizers]
        return save_full_streamed(path, checkpoint)
    if state_dict_type == "sharded":
        checkpoint["state_dict"] = sharded_model_state_dict(module)
        if optimizers:
            checkpoint["optimizer_states"] = [sharded_optim_state_dict(module, o) for o in optimizers]
        return write_sharded_checkpoint(checkpoint, path)
    raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
