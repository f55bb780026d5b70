"""Registration of the strategy names with Lightning's Trainer and Fabric registries (idempotent)."""

from __future__ import annotations

from typing import Any

__all__ = ["STRATEGY_NAMES", "register", "register_names"]

# name -> (description, init arguments)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "flatshard": ("flatshard: fully sharded (FULL_SHARD)", {"sharding_strategy": "FULL_SHARD"}),
    "flatshard_grad_op": (
        "flatshard: gradients and optimizer state sharded (SHARD_GRAD_OP)",
        {"sharding_strategy": "SHARD_GRAD_OP"},
    ),
    "flatshard_hybrid": (
        "flatshard: sharded within a node, replicated across nodes (HYBRID_SHARD)",
        {"sharding_strategy": "HYBRID_SHARD"},
    ),
    "flatshard_offload": ("flatshard: fully sharded with parameters offloaded to CPU", {"cpu_offload": True}),
}


def register_names(registry: Any, cls: type) -> None:
    for name, (description, init_params) in STRATEGY_NAMES.items():
        if name in registry:
            continue
        registry.register(name, cls, description=description, **init_params)


def register() -> None:
    """Register the names with the Trainer and Fabric registries. Calling it again is harmless."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from flatshard.lightning.fabric import FlatShardFabricStrategy
    from flatshard.lightning.strategy import FlatShardStrategy

    register_names(StrategyRegistry, FlatShardStrategy)
    register_names(FABRIC_REGISTRY, FlatShardFabricStrategy)
