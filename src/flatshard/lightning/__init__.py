"""Lightning integration: the Trainer strategy, the Fabric strategy, and their registration."""

from flatshard.lightning.fabric import FlatShardFabricStrategy
from flatshard.lightning.precision import FlatShardGradScaler, FlatShardPrecision
from flatshard.lightning.strategy import FlatShardStrategy
from flatshard.registration import register

__all__ = [
    "FlatShardFabricStrategy",
    "FlatShardGradScaler",
    "FlatShardPrecision",
    "FlatShardStrategy",
    "register",
]
