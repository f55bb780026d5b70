"""Lightning integration: the Trainer strategy, the Fabric strategy, and their registration."""

from flatshard.lightning.fabric import FlatShardFabricStrategy
from flatshard.lightning.precision import FlatShardGradScaler, FlatShardPrecision
from flatshard.lightning.registry import register
from flatshard.lightning.strategy import FlatShardStrategy

__all__ = [
    "FlatShardFabricStrategy",
    "FlatShardGradScaler",
    "FlatShardPrecision",
    "FlatShardStrategy",
    "register",
]
