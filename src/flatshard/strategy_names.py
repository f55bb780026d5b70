"""The strategy names flatshard adds to Lightning's registries, and how they are added. No imports: both
``flatshard.registration`` (at ``import flatshard``) and the strategies' ``register_strategies`` use it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["STRATEGY_NAMES", "register_names"]

# name -> (description, init arguments)
STRATEGY_NAMES: Mapping[str, tuple[str, dict[str, Any]]] = MappingProxyType(
    {
        "flatshard": ("flatshard: fully sharded (FULL_SHARD)", {"sharding_strategy": "FULL_SHARD"}),
        "flatshard_grad_op": (
            "flatshard: gradients and optimizer state sharded (SHARD_GRAD_OP)",
            {"sharding_strategy": "SHARD_GRAD_OP"},
        ),
        "flatshard_hybrid": (
            "flatshard: sharded within a node, replicated across nodes (HYBRID_SHARD)",
            {"sharding_strategy": "HYBRID_SHARD"},
        ),
        "flatshard_offload": (
            "flatshard: fully sharded with parameters offloaded to CPU",
            {"cpu_offload": True},
        ),
    }
)


def register_names(registry: Any, strategy: Callable[..., Any]) -> None:
    """Add every flatshard name to ``registry`` with ``strategy`` (a class or factory); existing names stay."""
    for name, (description, init_params) in STRATEGY_NAMES.items():
        if name in registry:
            continue
        registry.register(name, strategy, description=description, **init_params)
