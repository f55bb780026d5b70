"""Lightning integration: the Trainer strategy, the Fabric strategy, and their registration."""

from flatshard.lightning.ema import ShardedEMA
from flatshard.lightning.fabric import FlatShardFabricStrategy
from flatshard.lightning.precision import FlatShardGradScaler, FlatShardPrecision
from flatshard.lightning.pretrained import LoadPretrained
from flatshard.lightning.strategy import FlatShardStrategy
from flatshard.strategy_names import register_names

__all__ = [
    "FlatShardFabricStrategy",
    "FlatShardGradScaler",
    "FlatShardPrecision",
    "FlatShardStrategy",
    "LoadPretrained",
    "ShardedEMA",
    "register",
]


def register() -> None:
    """Register the strategy names with the Trainer and Fabric registries now. Idempotent; ``import flatshard``
    already does it (see [Note: registering without importing Lightning])."""
    import lightning.fabric.strategies
    import lightning.pytorch.strategies

    register_names(lightning.pytorch.strategies.StrategyRegistry, FlatShardStrategy)
    register_names(lightning.fabric.strategies.STRATEGY_REGISTRY, FlatShardFabricStrategy)
