"""Shard and replicate process groups for each sharding strategy, validated once at ``shard()`` time.

A unit's flat parameter is sharded over the *shard group*; ranks holding the same shard form the
*replicate group*, over which gradient shards are all-reduced. FULL_SHARD / SHARD_GRAD_OP shard over
the whole group and have no replicate group; NO_SHARD is the degenerate case of a one-rank shard group
replicated over everyone (that is what makes it behave like DDP on the same code path).

[Note: hybrid groups]
HYBRID_SHARD / HYBRID_SHARD_ZERO2 shard inside groups of ``k`` consecutive ranks (a node, by default)
and replicate across them: shard group ``i`` is ranks ``[i*k, (i+1)*k)``, replicate group ``j`` is ranks
``j, j+k, j+2k, ...``. Groups come from ``shard_group_size=k``, a ``(shard_group, replicate_group)``
tuple, or a 2-D ``DeviceMesh`` (dim 0 replicates, dim 1 shards, torch's convention). Groups made from
a size are created once per ``k`` and kept in the default group's state (see [Note: state per process
group]), so every unit of a model shares the same groups (required: a unit whose groups differ is refused),
and they go when the default group does.

A layout with one group on a side is the degenerate case of the other strategies, and runs as such (one info
log line says so): one shard group spanning every rank (one node, the default group size there) has nothing
to replicate across, so HYBRID_SHARD runs as FULL_SHARD and HYBRID_SHARD_ZERO2 as SHARD_GRAD_OP; one rank per
shard group shards nothing and replicates like NO_SHARD. So the config a user will run on many nodes runs on
one. A size that does not divide the world is refused.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from flatshard.engine.log_once import log_once
from flatshard.engine.transport.groups import state_of

if TYPE_CHECKING:
    from flatshard.engine.config import ShardingStrategy  # its values are only read

__all__ = ["hybrid_groups", "resolve_groups"]

log = logging.getLogger(__name__)


def resolve_groups(
    strategy: ShardingStrategy, process_group: Any | None, shard_group_size: int | None = None
) -> tuple[Any | None, Any | None]:
    """``(shard_group, replicate_group)``; ``None`` for a group of one rank or a non-distributed run."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(
                "shard(process_group=...) was given but torch.distributed is not initialized. "
                "HINT: call torch.distributed.init_process_group() first."
            )
        if strategy.is_hybrid:
            raise ValueError(
                f"sharding_strategy={strategy.name} needs torch.distributed to be initialized (it shards within "
                "groups and replicates across them). HINT: call torch.distributed.init_process_group() first."
            )
        return None, None
    if strategy.is_hybrid:
        return _resolve_hybrid(strategy, process_group, shard_group_size)
    if shard_group_size is not None:
        raise ValueError(
            f"shard_group_size={shard_group_size} only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not "
            f"{strategy.name}. HINT: drop it, or use a hybrid strategy."
        )
    if isinstance(process_group, tuple) or _is_mesh(process_group):
        raise ValueError(
            f"A (shard_group, replicate_group) tuple or a DeviceMesh is only valid for hybrid strategies, not "
            f"{strategy.name}."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if not strategy.shards:
        return None, (group if dist.get_world_size(group) > 1 else None)
    return group, None


def _is_mesh(value: Any) -> bool:
    return type(value).__name__ == "DeviceMesh" and hasattr(value, "get_group")


def _resolve_hybrid(
    strategy: ShardingStrategy, process_group: Any | None, shard_group_size: int | None
) -> tuple[Any, Any]:
    world = dist.get_world_size()
    if process_group is not None and shard_group_size is not None:
        raise ValueError(
            "Give either shard_group_size or process_group (a (shard_group, replicate_group) tuple or a "
            "DeviceMesh) for hybrid sharding, not both."
        )
    if process_group is not None and _is_mesh(process_group):
        if process_group.ndim != 2:
            raise ValueError(
                f"A DeviceMesh for {strategy.name} must be 2-D (replicate, shard), got {process_group.ndim}-D "
                f"with shape {tuple(process_group.shape)}."
            )
        shard, replicate = process_group.get_group(1), process_group.get_group(0)
    elif isinstance(process_group, tuple):
        if len(process_group) != 2:
            raise ValueError(
                f"process_group for {strategy.name} must be a (shard_group, replicate_group) pair, got "
                f"{len(process_group)} groups."
            )
        shard, replicate = process_group
    elif process_group is not None:
        raise ValueError(
            f"process_group for {strategy.name} must be a (shard_group, replicate_group) tuple or a 2-D "
            f"DeviceMesh, got {type(process_group).__name__}. HINT: or pass shard_group_size=k."
        )
    else:
        k = shard_group_size if shard_group_size is not None else _local_world_size(strategy)
        shard, replicate = hybrid_groups(k)
        _report_degenerate(strategy, k, world)
        return shard, replicate
    n_shard, n_replicate = dist.get_world_size(shard), dist.get_world_size(replicate)
    if n_shard * n_replicate != world:
        raise ValueError(
            f"{strategy.name}: shard group ({n_shard} ranks) x replicate group ({n_replicate} ranks) must "
            f"cover the world ({world} ranks)."
        )
    _report_degenerate(strategy, n_shard, world)
    return (shard if n_shard > 1 else None), (replicate if n_replicate > 1 else None)


def _local_world_size(strategy: ShardingStrategy) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        raise ValueError(
            f"{strategy.name} shards within a node by default, but the number of ranks per node is unknown "
            "(LOCAL_WORLD_SIZE is not set). HINT: pass shard_group_size=k (ranks per shard group)."
        )
    return int(value)


def _report_degenerate(strategy: ShardingStrategy, k: int, world: int) -> None:
    """One info line when a hybrid layout has one group on a side (see [Note: hybrid groups])."""
    if 1 < k < world or world == 1:
        return
    key = ("degenerate hybrid", strategy.name, k, world)
    if k >= world:
        runs_as = "FULL_SHARD" if strategy.reshard_after_forward else "SHARD_GRAD_OP"
        log_once(
            log,
            key,
            "flatshard: %s with one shard group of all %d ranks: one replica, nothing to replicate across; it "
            "runs as %s.",
            strategy.name,
            world,
            runs_as,
        )
    else:
        log_once(
            log,
            key,
            "flatshard: %s with shard groups of one rank: nothing is sharded; parameters are replicated over "
            "%d ranks as under NO_SHARD.",
            strategy.name,
            world,
        )


def hybrid_groups(k: int) -> tuple[Any, Any]:
    """This rank's (shard group, replicate group) for shard groups of ``k`` consecutive ranks (cached).

    ``None`` for a side of one rank: ``k`` equal to the world size gives ``(WORLD, None)`` (FULL_SHARD's
    groups), ``k = 1`` gives ``(None, WORLD)`` (NO_SHARD's). Every rank must call it with the same ``k``
    (group creation is collective).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"shard_group_size must be an int, got {type(k).__name__}: {k!r}.")
    if k < 1 or world % k != 0:
        raise ValueError(
            f"shard_group_size={k} does not divide the world size {world}. HINT: use a divisor of {world} "
            "(usually the number of devices per node)."
        )
    if k == world or k == 1:
        whole = dist.group.WORLD if world > 1 else None
        return (whole, None) if k == world else (None, whole)
    made = state_of(None).hybrid  # kept by the default group, and dropped with it
    if k not in made:
        shards = [dist.new_group(list(range(i * k, (i + 1) * k))) for i in range(world // k)]
        replicas = [dist.new_group(list(range(j, world, k))) for j in range(k)]
        made[k] = (shards, replicas)
    shards, replicas = made[k]
    return shards[rank // k], replicas[rank % k]


def node_local_group(shard_group: Any, k: int) -> Any:
    """This rank's group of ``k`` consecutive ranks of its shard group (see ``reshard_after_forward``; ``k``
    divides the shard group's size), cached by the default group. Collective over every rank: each one's shard
    group is exchanged, and every such group of every shard group is created in the same order on all ranks."""
    world_ranks = tuple(dist.get_process_group_ranks(shard_group))
    world_state = state_of(None)
    made = world_state.node_local  # kept by the default group, and dropped with it
    key = (k, world_ranks)
    if key not in made:
        world, size = dist.get_world_size(), len(world_ranks)
        known = world_ranks == tuple(range(world)) or any(  # the whole world, or hybrid_groups' own groups
            shard_group in shards for s, (shards, _) in world_state.hybrid.items() if s == size
        )
        if known:  # every shard group is consecutive ranks: nothing to exchange (a fake group moves nothing)
            everyone: list[Any] = [tuple(range(i, i + size)) for i in range(0, world, size)]
        else:
            everyone = [None] * world
            dist.all_gather_object(everyone, world_ranks)
        blocks = sorted({g[i : i + k] for g in set(everyone) for i in range(0, len(g), k)})
        created = {block: dist.new_group(list(block)) for block in blocks}  # the same order on every rank
        rank = dist.get_rank()
        made[key] = created[next(b for b in blocks if rank in b and set(b) <= set(world_ranks))]
    return made[key]
