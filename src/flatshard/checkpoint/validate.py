"""Checks every loader runs before anything is applied, and their agreement across ranks."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from flatshard.checkpoint.errors import CheckpointError

__all__ = ["agree_on_error", "check_optimizer_count", "check_required"]


def check_required(path: object, extra: Mapping[str, Any], required: Collection[str]) -> None:
    """Raise before anything is applied if the checkpoint lacks an entry the caller needs (every rank reads
    the same checkpoint, so every rank raises alike)."""
    missing = [k for k in required if k not in extra]
    if missing:
        raise KeyError(
            f"Checkpoint {path} has no entries {missing}; nothing was loaded. HINT: pass strict=False to skip "
            "them."
        )


def agree_on_error(error: BaseException | None, what: str = "Loading") -> None:
    """Raise on every rank if a step (validation, a storage check, a write) failed on any, so no rank goes on
    alone; ``what`` names the step in the error the other ranks raise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def check_optimizer_count(path: object, saved: int | None, optimizers: Sequence[Any]) -> None:
    if saved is None:
        raise CheckpointError(
            f"Checkpoint {path} holds only the model (no optimizer states), so training cannot resume from it. "
            "HINT: it was probably saved with save_weights_only=True; load it for inference, or load weights "
            "only with flatshard.load_checkpoint(path, module)."
        )
    if saved != len(optimizers):
        raise CheckpointError(
            f"Checkpoint {path} holds {saved} optimizer states but {len(optimizers)} optimizers were given. HINT: "
            "resume with the same optimizers (configure_optimizers) as when it was saved."
        )
