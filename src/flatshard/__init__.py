"""flatshard: a sharded-training strategy for PyTorch Lightning with an engine of its own.

``import flatshard`` registers the strategy names (``"flatshard"``, ``"flatshard_grad_op"``,
``"flatshard_hybrid"``, ``"flatshard_offload"``) with Lightning's Trainer and Fabric, without importing
Lightning (see [Note: registering without importing Lightning]); ``flatshard.FlatShardStrategy`` and
``flatshard.FlatShardFabricStrategy`` import it when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flatshard.checkpoint import (
    CheckpointError,
    PretrainedLoad,
    consolidate,
    load_checkpoint,
    load_pretrained,
    save_checkpoint,
    save_pretrained,
)
from flatshard.engine import (
    EMA,
    BackwardPrefetch,
    CPUOffload,
    DesyncError,
    MixedPrecision,
    ParamShard,
    ShardingStrategy,
    ShardOptions,
    UnfilledError,
    clip_grad_norm_,
    get_state_dict,
    is_sharded,
    join,
    no_sync,
    original_shapes,
    register_forward_method,
    register_whole_tensor_optimizer,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_forward,
    set_state_dict,
    shard,
    unshard_params,
)
from flatshard.registration import install as _install_registration
from flatshard.version import __version__

if TYPE_CHECKING:
    from flatshard.estimator import estimate
    from flatshard.lightning import FlatShardFabricStrategy, FlatShardStrategy


_install_registration()


def __getattr__(name: str) -> Any:
    if name == "ShardedEMA":  # the engine's EMA's former name; flatshard.lightning.ShardedEMA is the callback
        import warnings

        warnings.warn(
            "flatshard.ShardedEMA is now flatshard.EMA (flatshard.lightning.ShardedEMA is the Trainer callback).",
            FutureWarning,
            stacklevel=2,
        )
        return EMA
    if name == "estimate":  # the estimator is imported when first used: see flatshard/estimator/
        from flatshard.estimator import estimate

        return estimate
    if name in ("FlatShardStrategy", "FlatShardFabricStrategy", "lightning"):
        import flatshard.lightning

        return flatshard.lightning if name == "lightning" else getattr(flatshard.lightning, name)
    raise AttributeError(f"module 'flatshard' has no attribute {name!r}")


__all__ = [
    "EMA",
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointError",
    "DesyncError",
    "FlatShardFabricStrategy",
    "FlatShardStrategy",
    "MixedPrecision",
    "ParamShard",
    "PretrainedLoad",
    "ShardOptions",
    "ShardingStrategy",
    "UnfilledError",
    "__version__",
    "clip_grad_norm_",
    "consolidate",
    "estimate",
    "get_state_dict",
    "is_sharded",
    "join",
    "load_checkpoint",
    "load_pretrained",
    "no_sync",
    "original_shapes",
    "register_forward_method",
    "register_whole_tensor_optimizer",
    "save_checkpoint",
    "save_pretrained",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_forward",
    "set_state_dict",
    "shard",
    "unshard_params",
]
