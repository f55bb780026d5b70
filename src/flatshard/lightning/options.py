"""Strategy arguments, validated once and shared by the Trainer and Fabric strategies.

Every argument is checked here, with an error that names it and a hint; no argument is ever silently
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flatshard.engine.checkpointing import CheckFn, resolve_checkpointing_policy
from flatshard.engine.config import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    normalize_backward_prefetch,
    normalize_cpu_offload,
    normalize_mixed_precision,
    normalize_sharding_strategy,
)
from flatshard.engine.wrap import Policy, resolve_policy

__all__ = ["StrategyOptions"]

_STATE_DICT_TYPES = ("full", "sharded")
_START_METHODS = ("popen", "spawn")
_GRAD_ACCUMULATION = ("sharded", "no_sync")


@dataclass(frozen=True)
class StrategyOptions:
    sharding_strategy: ShardingStrategy
    auto_wrap_policy: Policy | None
    activation_checkpointing_policy: CheckFn | None
    mixed_precision: MixedPrecision | None
    cpu_offload: bool
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    state_dict_type: str
    sync_module_states: bool
    param_init_fn: Any
    start_method: str
    grad_accumulation: str = "sharded"
    shard_group_size: int | None = None
    process_group: Any = None
    device_mesh: Any = None

    @classmethod
    def create(
        cls,
        *,
        sharding_strategy: Any,
        auto_wrap_policy: Any,
        activation_checkpointing_policy: Any,
        cpu_offload: Any,
        mixed_precision: Any,
        limit_all_gathers: Any,
        backward_prefetch: Any,
        forward_prefetch: Any,
        state_dict_type: Any,
        sync_module_states: Any,
        param_init_fn: Any,
        shard_group_size: Any,
        process_group: Any,
        device_mesh: Any,
        start_method: Any,
        grad_accumulation: Any = "sharded",
    ) -> StrategyOptions:
        strategy = normalize_sharding_strategy(sharding_strategy)
        given = {
            k: v
            for k, v in (
                ("shard_group_size", shard_group_size),
                ("process_group", process_group),
                ("device_mesh", device_mesh),
            )
            if v is not None
        }
        if given and not strategy.is_hybrid:
            raise ValueError(
                f"{', '.join(given)} only apply to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {strategy.name}. HINT: "
                "set sharding_strategy='HYBRID_SHARD', or drop them."
            )
        if len(given) > 1:
            raise ValueError(
                f"Give one of shard_group_size, process_group, device_mesh, not {', '.join(given)}."
            )
        if shard_group_size is not None and (
            not isinstance(shard_group_size, int)
            or isinstance(shard_group_size, bool)
            or shard_group_size < 1
        ):
            raise TypeError(f"shard_group_size must be a positive int, got {shard_group_size!r}.")
        if process_group is not None and not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise TypeError(
                f"process_group must be a (shard_group, replicate_group) tuple, got {type(process_group).__name__}."
            )
        if isinstance(device_mesh, (tuple, list)):
            if len(device_mesh) != 2 or not all(isinstance(d, int) and d > 0 for d in device_mesh):
                raise ValueError(
                    f"device_mesh={device_mesh!r} must be (replicas, ranks per shard group), two positive ints."
                )
            device_mesh = tuple(device_mesh)
        elif device_mesh is not None and type(device_mesh).__name__ != "DeviceMesh":
            raise TypeError(
                f"device_mesh must be a (replicas, shard group size) tuple or a 2-D DeviceMesh, got "
                f"{type(device_mesh).__name__}."
            )
        checkpoint_check = resolve_checkpointing_policy(activation_checkpointing_policy)
        for arg, value in (
            ("limit_all_gathers", limit_all_gathers),
            ("forward_prefetch", forward_prefetch),
            ("sync_module_states", sync_module_states),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{arg} must be a bool, got {type(value).__name__}: {value!r}.")
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError(
                f"param_init_fn must be a callable taking a module, got {type(param_init_fn).__name__}."
            )
        if grad_accumulation not in _GRAD_ACCUMULATION:
            raise ValueError(
                f"grad_accumulation={grad_accumulation!r} is not one of {_GRAD_ACCUMULATION}. HINT: 'sharded' "
                "reduce-scatters every micro-batch (least memory), 'no_sync' reduces once per optimizer step."
            )
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not one of {_STATE_DICT_TYPES}.")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not one of {_START_METHODS}.")
        return cls(
            sharding_strategy=strategy,
            auto_wrap_policy=resolve_policy(auto_wrap_policy),
            activation_checkpointing_policy=checkpoint_check,
            mixed_precision=normalize_mixed_precision(mixed_precision),
            cpu_offload=normalize_cpu_offload(cpu_offload),
            backward_prefetch=normalize_backward_prefetch(backward_prefetch),
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            state_dict_type=state_dict_type,
            sync_module_states=sync_module_states,
            param_init_fn=param_init_fn,
            start_method=start_method,
            grad_accumulation=grad_accumulation,
            shard_group_size=shard_group_size,
            process_group=process_group,
            device_mesh=device_mesh,
        )

    def shard_kwargs(
        self,
        device: torch.device,
        precision: MixedPrecision | None = None,
        ranks_per_node: int = 1,
        world_size: int = 1,
    ) -> dict[str, Any]:
        """Arguments for ``flatshard.shard`` on ``device``; ``precision`` is the engine's config for the
        precision flag (``mixed_precision_for``, which also honours and checks an explicit
        ``mixed_precision``). Hybrid strategies shard within a node (``ranks_per_node``) unless the groups
        were given."""
        return {
            **self._group_kwargs(ranks_per_node, world_size),
            "mixed_precision": precision,
            "sharding_strategy": self.sharding_strategy,
            "auto_wrap_policy": self.auto_wrap_policy,
            "activation_checkpointing_policy": self.activation_checkpointing_policy,
            "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            "sync_module_states": self.sync_module_states,
            "param_init_fn": self.param_init_fn,
            "cpu_offload": self.cpu_offload,
            "device": device,
        }

    def _group_kwargs(self, ranks_per_node: int, world_size: int) -> dict[str, Any]:
        if not self.sharding_strategy.is_hybrid:
            return {}
        if self.process_group is not None:
            return {"process_group": self.process_group}
        if isinstance(self.device_mesh, tuple):
            replicas, size = self.device_mesh
            if replicas * size != world_size:
                raise ValueError(
                    f"device_mesh={self.device_mesh} has {replicas * size} ranks but the world has {world_size}. "
                    f"HINT: (replicas, ranks per shard group) must multiply to {world_size}."
                )
            return {"shard_group_size": size}
        if self.device_mesh is not None:
            return {"process_group": self.device_mesh}
        return {"shard_group_size": self.shard_group_size or ranks_per_node}
