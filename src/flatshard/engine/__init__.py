"""The sharding engine: no Lightning import here; usable from plain PyTorch."""

from flatshard.engine.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from flatshard.engine.shard import is_sharded, no_sync, shard, unit_states

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "ShardingStrategy",
    "is_sharded",
    "no_sync",
    "shard",
    "unit_states",
]
