"""Strategy arguments, validated once and shared by the Trainer and Fabric strategies.

Arguments whose feature lands in a later release raise ``NotImplementedError`` naming the feature
when set to anything but their default; no argument is ever silently ignored.
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


def _later(arg: str, value: Any, feature: str, issue: str) -> NotImplementedError:
    return NotImplementedError(
        f"{arg}={value!r}: {feature} is not available in this flatshard release yet ({issue}). "
        f"HINT: leave {arg} at its default for now."
    )


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
        if strategy.is_hybrid:
            raise _later("sharding_strategy", strategy.name, "hybrid sharding", "the hybrid sharding issue")
        for arg, value in (
            ("shard_group_size", shard_group_size),
            ("process_group", process_group),
            ("device_mesh", device_mesh),
        ):
            if value is not None:
                raise _later(arg, value, "hybrid sharding groups", "the hybrid sharding issue")
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
        )

    def shard_kwargs(self, device: torch.device, precision: MixedPrecision | None = None) -> dict[str, Any]:
        """Arguments for ``flatshard.shard`` on ``device``; ``precision`` is the precision plugin's config,
        used unless ``mixed_precision`` was given explicitly."""
        return {
            "mixed_precision": self.mixed_precision if self.mixed_precision is not None else precision,
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
