"""Shard and replicate process groups for each sharding strategy, validated once at ``shard()`` time.

A unit's flat parameter is sharded over the *shard group*; ranks holding the same shard form the
*replicate group*, over which gradient shards are all-reduced. FULL_SHARD / SHARD_GRAD_OP shard over
the whole group and have no replicate group; NO_SHARD is the degenerate case of a one-rank shard group
replicated over everyone (that is what makes it behave like DDP on the same code path).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from flatshard.engine.config import ShardingStrategy

__all__ = ["resolve_groups"]


def resolve_groups(strategy: ShardingStrategy, process_group: Any | None) -> tuple[Any | None, Any | None]:
    """``(shard_group, replicate_group)``; ``None`` for a group of one rank or a non-distributed run."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(
                "shard(process_group=...) was given but torch.distributed is not initialized. "
                "HINT: call torch.distributed.init_process_group() first."
            )
        return None, None
    if strategy.is_hybrid:
        raise NotImplementedError("hybrid sharding groups arrive with the hybrid sharding issue.")
    if isinstance(process_group, tuple):
        raise ValueError(
            f"A (shard_group, replicate_group) tuple is only valid for hybrid strategies, not {strategy.name}."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return None, (group if dist.get_world_size(group) > 1 else None)
    return group, None
