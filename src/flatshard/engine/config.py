"""Configuration enums and frozen dataclasses for the sharding engine.

Every user-facing option is normalised here once (strings to enums, bad values to a ``ValueError`` that
lists the accepted values), so the rest of the engine only ever sees typed values.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "ShardingStrategy",
    "normalize_backward_prefetch",
    "normalize_cpu_offload",
    "normalize_mixed_precision",
    "normalize_sharding_strategy",
]


class ShardingStrategy(enum.Enum):
    """What is sharded, and when parameters are resharded.

    - ``FULL_SHARD``: parameters, gradients and optimizer state are sharded; parameters are gathered for
      a unit's forward, freed after it, gathered again for its backward (ZeRO-3).
    - ``SHARD_GRAD_OP``: gradients and optimizer state are sharded; gathered parameters stay from a unit's
      forward until the end of its backward (ZeRO-2).
    - ``NO_SHARD``: nothing is sharded; gradients are all-reduced (like DDP).
    - ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2``: FULL_SHARD / SHARD_GRAD_OP inside a shard group, data
      parallel across groups.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a (non-root) unit frees its gathered parameters right after its forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward."""

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


def _normalize_enum(value: object, enum_cls: type[enum.Enum], arg: str) -> enum.Enum:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        key = value.strip().upper()
        if key in enum_cls.__members__:
            return enum_cls[key]
        choices = ", ".join(repr(m) for m in enum_cls.__members__)
        raise ValueError(f"Unknown {arg}={value!r}. HINT: use one of {choices} (case-insensitive).")
    # Accept the same-named enum from torch.distributed.fsdp (migration from strategy="fsdp").
    name = getattr(value, "name", None)
    if isinstance(name, str) and name in enum_cls.__members__:
        return enum_cls[name]
    raise TypeError(
        f"{arg} must be a {enum_cls.__name__} or its name as a string, got {type(value).__name__}: {value!r}."
    )


def normalize_sharding_strategy(value: ShardingStrategy | str) -> ShardingStrategy:
    """``"full_shard"`` / ``ShardingStrategy.FULL_SHARD`` / torch's enum of the same name -> our enum."""
    result = _normalize_enum(value, ShardingStrategy, "sharding_strategy")
    assert isinstance(result, ShardingStrategy)
    return result


def normalize_backward_prefetch(value: BackwardPrefetch | str | None) -> BackwardPrefetch | None:
    if value is None:
        return None
    result = _normalize_enum(value, BackwardPrefetch, "backward_prefetch")
    assert isinstance(result, BackwardPrefetch)
    return result


@dataclass(frozen=True)
class MixedPrecision:
    """Compute / communication dtypes. ``None`` means "the parameter's own dtype".

    Args:
        param_dtype: dtype of the gathered parameters used for compute. Default: ``None``.
        reduce_dtype: dtype gradients are reduced in; defaults to ``param_dtype`` when that is set.
        buffer_dtype: dtype buffers are cast to for compute. Default: ``None``.
        keep_low_precision_grads: keep gradient shards in ``reduce_dtype`` instead of casting them to the
            parameters' dtype (for optimizers that handle low-precision gradients). Default: ``False``.
        cast_forward_inputs: cast floating-point forward inputs of each unit to ``param_dtype``, inside
            autograd. Default: ``True``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        bad = [
            f"{name}={getattr(self, name)!r}"
            for name in ("param_dtype", "reduce_dtype", "buffer_dtype")
            if getattr(self, name) is not None and not isinstance(getattr(self, name), torch.dtype)
        ]
        if bad:
            raise TypeError(
                f"MixedPrecision got non-dtype values: {', '.join(bad)}. HINT: pass e.g. torch.bfloat16."
            )
        not_float = [
            f"{name}={getattr(self, name)}"
            for name in ("param_dtype", "reduce_dtype", "buffer_dtype")
            if getattr(self, name) is not None and not getattr(self, name).is_floating_point
        ]
        if not_float:
            raise ValueError(
                f"MixedPrecision dtypes must be floating point, got {', '.join(not_float)}. HINT: use "
                "torch.bfloat16, torch.float16 or torch.float32."
            )
        not_bool = [
            f"{name}={getattr(self, name)!r}"
            for name in ("keep_low_precision_grads", "cast_forward_inputs")
            if not isinstance(getattr(self, name), bool)
        ]
        if not_bool:
            raise TypeError(
                f"MixedPrecision flags must be bools, got {', '.join(not_bool)}. HINT: pass True or False."
            )


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded parameters and gradients on CPU; the optimizer steps there.

    Args:
        offload_params: whether to offload. Default: ``False``.
    """

    offload_params: bool = False


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


def _to_dtype(value: object, field: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise ValueError(
        f"mixed_precision.{field}={value!r} is not a floating-point dtype. HINT: use a torch.dtype or one of "
        f"{', '.join(repr(k) for k in _DTYPE_NAMES)}."
    )


def normalize_mixed_precision(value: object) -> MixedPrecision | None:
    """``None`` / a :class:`MixedPrecision` / a mapping of its fields (dtypes may be strings) -> ours.

    torch FSDP's ``MixedPrecision`` is accepted too (same field names), for migration. Its default casts the
    root's forward inputs only (``cast_root_forward_inputs=True``, ``cast_forward_inputs=False``); here that
    becomes ``cast_forward_inputs=True``: every unit casts its floating-point inputs, which changes nothing for
    inputs already in ``param_dtype`` and keeps an fp32 tensor from meeting low-precision weights in any unit.
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    fields = (
        "param_dtype",
        "reduce_dtype",
        "buffer_dtype",
        "keep_low_precision_grads",
        "cast_forward_inputs",
    )
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(
                f"mixed_precision has unknown fields {unknown}. HINT: the fields are {', '.join(fields)}."
            )
        raw = dict(value)
    elif all(hasattr(value, f) for f in fields[:3]):
        raw = {f: getattr(value, f) for f in fields if hasattr(value, f)}
        if getattr(value, "cast_root_forward_inputs", False) is True:  # torch's MixedPrecision: see above
            raw["cast_forward_inputs"] = True
        kept = getattr(value, "_module_classes_to_ignore", None)
        if kept is not None and set(kept) != {_BatchNorm}:
            raise ValueError(
                f"mixed_precision._module_classes_to_ignore={tuple(kept)!r}: flatshard keeps batch norms (only) in "
                "full precision. HINT: leave it at torch's default; to keep another module in full precision, "
                "shard() it on its own first, without mixed_precision, then the model."
            )
    else:
        raise TypeError(
            f"mixed_precision must be a flatshard.MixedPrecision, a mapping of its fields or None, got "
            f"{type(value).__name__}: {value!r}."
        )
    for f in fields[:3]:
        if f in raw:
            raw[f] = _to_dtype(raw[f], f)
    return MixedPrecision(**raw)


def normalize_cpu_offload(value: object) -> bool:
    """``None`` / ``bool`` / :class:`CPUOffload` (or torch FSDP's, same field) -> whether to offload."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    offload = getattr(value, "offload_params", None)
    if isinstance(offload, bool):
        return offload
    raise TypeError(
        f"cpu_offload must be a bool or flatshard.CPUOffload(offload_params=...), got {type(value).__name__}: {value!r}."
    )
