"""Configuration: enums, the precision / offload records, and :class:`ShardOptions`, every option of
``shard()`` in one frozen dataclass.

Every user-facing option is normalised here once (strings to enums, import paths to classes, bad values to
one error that lists every bad field with the accepted values), so the rest of the engine only ever sees
typed values. The Trainer and Fabric strategies embed the same record (``flatshard.lightning.options``):
adding an option means a field here, a parameter in the two strategy signatures, and the docs.
"""

from __future__ import annotations

import datetime
import enum
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from flatshard.engine.setup.activation_checkpointing import (
    CheckFn,
    CheckpointMode,
    resolve_checkpointing_mode,
    resolve_checkpointing_policy,
)
from flatshard.engine.setup.wrap import Policy, resolve_policy

__all__ = [
    "OFFLOAD_OPTIMIZER",
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "OptionErrors",
    "ShardOptions",
    "ShardingStrategy",
    "check_reshard_after_forward",
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

    @property
    def shards(self) -> bool:
        """Whether parameters are split across ranks at all (every strategy but ``NO_SHARD``)."""
        return self is not ShardingStrategy.NO_SHARD


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
    """What lives in host (CPU) memory instead of on the compute device.

    Args:
        offload_params: shards, gradient shards and optimizer state on the host; the optimizer steps there and
            each unit is copied to the device for its gather (torch FSDP's ``offload_params``). Default:
            ``False``.
        offload_optimizer: only the optimizer state (and its step) on the host; shards and gradient shards stay
            on the device (DeepSpeed's ``offload_optimizer``, ZeRO-Offload). With ``offload_params=True`` it
            changes nothing: that already keeps the optimizer state on the host. Default: ``False``.
    """

    offload_params: bool = False
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        bad = [
            f"{name}={getattr(self, name)!r}"
            for name in ("offload_params", "offload_optimizer")
            if not isinstance(getattr(self, name), bool)
        ]
        if bad:
            raise TypeError(
                f"CPUOffload flags must be bools, got {', '.join(bad)}. HINT: pass True or False."
            )


_DTYPE_NAMES = MappingProxyType(
    {
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
)


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


OFFLOAD_OPTIMIZER = "optimizer"  # the normalised ``cpu_offload`` that keeps only the optimizer on the host


def normalize_cpu_offload(value: object) -> bool | str:
    """``None`` / ``bool`` / ``"optimizer"`` / :class:`CPUOffload` (or torch FSDP's, same field) -> ``False`` (no
    offload), ``True`` (shards, gradients and optimizer on the host) or ``"optimizer"`` (optimizer state only)."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value.strip().lower() == OFFLOAD_OPTIMIZER:
            return OFFLOAD_OPTIMIZER
        raise ValueError(
            f"cpu_offload={value!r} is not an offload mode. HINT: pass True (shards, gradients and optimizer state "
            "in host memory), 'optimizer' (only the optimizer state and its step) or False."
        )
    params = getattr(value, "offload_params", None)
    optimizer = getattr(value, "offload_optimizer", False)  # torch FSDP's CPUOffload has no such field
    if isinstance(params, bool) and isinstance(optimizer, bool):
        return True if params else OFFLOAD_OPTIMIZER if optimizer else False
    raise TypeError(
        f"cpu_offload must be a bool, 'optimizer' or flatshard.CPUOffload(offload_params=..., offload_optimizer=...), "
        f"got {type(value).__name__}: {value!r}."
    )


T = TypeVar("T")


class OptionErrors:
    """Collects what is wrong with a set of options, so one error lists every bad field.

    One problem is raised as it is (its type and message); several become one ``TypeError`` when all are
    type errors, else one ``ValueError``, listing each.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.problems: list[Exception] = []

    def check(self, normalize: Callable[..., T], *args: Any) -> T | None:
        """``normalize(*args)``, or ``None`` with its error recorded."""
        try:
            return normalize(*args)
        except (TypeError, ValueError, ImportError) as err:
            self.extend(err)
            return None

    def extend(self, other: BaseException) -> None:
        """Take in ``other``: one problem, or each problem an error listing several (:meth:`raise_if_any`)."""
        inner = getattr(other, "problems", None)
        self.problems.extend(inner if isinstance(inner, list) else [other])  # type: ignore[list-item]

    def raise_if_any(self) -> None:
        if not self.problems:
            return
        if len(self.problems) == 1:
            raise self.problems[0]
        kind = TypeError if all(isinstance(p, TypeError) for p in self.problems) else ValueError
        listed = "\n".join(f"  - {p}" for p in self.problems)
        error = kind(f"{self.what}: {len(self.problems)} options are wrong:\n{listed}")
        error.problems = list(self.problems)  # type: ignore[union-attr]
        raise error


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}.")
    return value


def _check_reshard_root(value: object, strategy: object) -> bool:
    flag = _check_bool("reshard_root_after_forward", value)
    try:
        strategy = normalize_sharding_strategy(strategy)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return flag  # the strategy's own error is reported
    if flag and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError(
            "reshard_root_after_forward=True has nothing to free under NO_SHARD: parameters are never gathered. "
            "HINT: drop it, or use FULL_SHARD / SHARD_GRAD_OP."
        )
    return flag


def check_reshard_after_forward(value: object, strategy: object = None) -> bool | int | None:
    """``None``, a bool, or a positive int (see ``ShardOptions.reshard_after_forward``)."""
    if value is None or isinstance(value, bool):
        pass
    elif not isinstance(value, int) or value < 1:
        raise TypeError(
            f"reshard_after_forward must be None, a bool or a positive int (ranks per node), got "
            f"{type(value).__name__}: {value!r}. HINT: True frees gathered units after forward, False keeps them, "
            "k keeps a copy sharded over k ranks for backward."
        )
    try:
        strategy = normalize_sharding_strategy(strategy) if strategy is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return value  # the strategy's own error is reported
    if strategy is ShardingStrategy.NO_SHARD and value not in (None, False):
        raise ValueError(
            f"reshard_after_forward={value!r} has nothing to free under NO_SHARD: parameters are never gathered. "
            "HINT: drop it, or use FULL_SHARD / HYBRID_SHARD."
        )
    return value


def _check_whole_tensor_optimizers(value: object) -> tuple[type, ...]:
    """Optimizer classes (or their import paths) that need each parameter whole."""
    items = [value] if isinstance(value, str | type) else value
    if not isinstance(items, list | tuple | set | frozenset):
        raise TypeError(
            f"whole_tensor_optimizers must be optimizer classes or their import paths, got {type(value).__name__}: "
            f"{value!r}."
        )
    out = []
    for item in items:
        cls = item
        if isinstance(item, str):
            module_name, _, name = item.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), name) if module_name else None
            except (ImportError, AttributeError) as err:
                raise ValueError(
                    f"whole_tensor_optimizers entry {item!r} could not be imported: {err}"
                ) from err
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"whole_tensor_optimizers entry {item!r} is not a torch.optim.Optimizer subclass. HINT: name the "
                "optimizer's class, e.g. 'my_package.optim.Shampoo'."
            )
        out.append(cls)
    return tuple(out)


def _check_checkpointing_mode(value: object, policy: object) -> CheckpointMode:
    mode = resolve_checkpointing_mode(value)
    if mode != "full" and policy is None:
        raise ValueError(
            f"activation_checkpointing_mode={value!r} says what checkpointed modules keep, and no module is "
            "checkpointed: activation_checkpointing_policy is None. HINT: set activation_checkpointing_policy as "
            "well, e.g. activation_checkpointing_policy={TransformerBlock} (the classes of your layers)."
        )
    return mode


def _check_param_init_fn(value: object) -> Callable[[nn.Module], None] | None:
    if value is not None and not callable(value):
        raise TypeError(f"param_init_fn must be a callable taking a module, got {type(value).__name__}.")
    return value  # type: ignore[return-value]


def _check_device_mesh(value: object) -> Any:
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
        ):
            raise ValueError(
                f"device_mesh={value!r} must be (replicas, ranks per shard group), two positive ints."
            )
        return tuple(value)
    if value is not None and not (type(value).__name__ == "DeviceMesh" and hasattr(value, "get_group")):
        raise TypeError(
            f"device_mesh must be a (replicas, shard group size) tuple or a torch DeviceMesh, got "
            f"{type(value).__name__}. HINT: torch.distributed.device_mesh.init_device_mesh(device, shape, "
            "mesh_dim_names=...)."
        )
    return value


def _check_shard_group_size(value: object) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise TypeError(f"shard_group_size must be a positive int, got {value!r}.")
    return value  # type: ignore[return-value]


def _check_desync_timeout(value: object) -> float | None:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"desync_timeout must be a positive number of seconds, a timedelta or None (never report), got "
            f"{value!r}. HINT: the default is 60; raise it for steps whose collectives legitimately pause "
            "longer, or pass None to wait as the process group does."
        )
    return float(value)


def _check_device(value: object) -> torch.device | None:
    if value is None or isinstance(value, torch.device):
        return value
    try:
        return torch.device(value)  # type: ignore[call-overload,no-any-return]
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device={value!r} is not a device ({err}). HINT: pass e.g. 'cpu', 'cuda', 'cuda:1' or torch.device."
        ) from None


@dataclass(frozen=True)
class ShardOptions:
    """Every option of :func:`flatshard.shard`, normalised and validated once, in one record.

    Construct it with the user's values (strings for enums and dtypes, import paths for module classes are
    fine); afterwards each field holds its normalised type. A bad value raises at construction, and with
    several bad values one error lists them all. ``dataclasses.replace`` re-validates.

    Args:
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"``
            (FULL_SHARD inside shard groups, replicated across them) or ``"HYBRID_SHARD_ZERO2"``
            (SHARD_GRAD_OP inside); see [Note: hybrid groups].
        auto_wrap_policy: which submodules become units of their own: ``None`` (default, only the root),
            a set of module classes (or import paths), an int (minimum parameters per unit), or a callable
            ``(module, recurse, nonwrapped_numel) -> bool`` (torch FSDP's policy contract).
        activation_checkpointing_policy: which submodules recompute their activations in backward instead
            of keeping them (see [Note: activation checkpointing]): module classes or their import paths,
            an int (modules with at least that many parameters), a callable ``module -> bool`` or a policy
            callable in torch FSDP's style. The outermost matching modules are checkpointed (non-reentrant);
            parameter names and checkpoints do not change. Default: ``None``.
        activation_checkpointing_mode: what a module ``activation_checkpointing_policy`` selects keeps for
            backward (see [Note: selective checkpointing]): ``"full"`` (default): its inputs only, its whole
            forward is recomputed. ``"selective"``: also the outputs of matrix products, attention kernels and
            functional collectives; only the cheap operators between them (norms, activations, dropout, with
            the same random numbers) are recomputed: more memory than ``"full"``, less recomputation. Or a list
            of the operators to keep, named as in ``torch.ops`` (``["aten.mm", "aten.addmm"]``). Needs
            ``activation_checkpointing_policy``.
        mixed_precision: a :class:`MixedPrecision` (or a mapping of its fields, dtypes as strings like
            ``"bf16"``): gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, keep
            fp32 shards for the optimizer and checkpoints (see [Note: mixed precision]). Batch-norm
            modules become units of their own in full precision. Default: ``None`` (full precision; under a
            strategy, what its precision flag implies: ``"bf16-mixed"`` computes and reduces in bf16, and an
            explicit value's fields replace those dtypes, the fields it leaves unset keeping them).
        cpu_offload: ``True`` or ``CPUOffload(offload_params=True)``: shards and gradient shards in CPU
            memory (pinned with CUDA compute), so the optimizer steps on CPU; each unit is copied to the
            compute device for its gather (see [Note: CPU offload]). ``"optimizer"`` or
            ``CPUOffload(offload_optimizer=True)``: only the optimizer state and its step live in CPU memory;
            shards and gradients stay on the device, each step copies the gradient shards to the host (started
            in backward) and the updated shards back (see [Note: optimizer offload]). The step runs the
            optimizer's CPU implementation: ``torch.optim.AdamW(fused=True)`` is the fast path. On a CPU device
            it saves nothing. Normalised to ``False``, ``True`` or ``"optimizer"``. Default: ``False``.
        activation_offload: keep the activations each unit saves for backward in host memory from the end of
            its forward until its backward: copied to pinned memory on a side stream as the unit's forward
            returns, and back one unit ahead in backward, so the device holds about two units' activations
            instead of all of them (see [Note: activation offload]). Saved tensors under 256 KiB, parameters
            and what the root saves after its last unit stay on the device, so it needs units below the root
            (``auto_wrap_policy``). With ``activation_checkpointing_policy`` the checkpointed modules' inputs
            move. On a CPU device it changes nothing (activations are in host memory already). Default:
            ``False``.
        limit_all_gathers: rate-limit all-gathers so at most two unsharded buffers are pending
            (see ``flatshard.engine.transport.limiter``; CUDA only, CPU work is synchronous). Default: ``True``.
        backward_prefetch: when to issue the next unit's all-gather in backward: ``"BACKWARD_PRE"``
            (default: before the current unit's gradient computation, more overlap), ``"BACKWARD_POST"``
            (after it, less memory) or ``None``.
        forward_prefetch: issue the next unit's all-gather before the current unit's forward compute.
            Default: ``False``.
        reshard_root_after_forward: free the root unit's gathered parameters when its training forward
            returns and gather them again when backward reaches its outputs, as other units do under
            FULL_SHARD (torch FSDP2's ``reshard_after_forward=True`` on the root). Saves the root's unsharded
            size (often the embedding) while the loss and its gradient are computed outside the model, the
            peak of many language models, for one more all-gather of the root per step. No effect where the
            loss is computed inside the root's forward, as in a LightningModule's ``training_step`` under the
            Trainer. Refused under NO_SHARD (nothing is gathered). Default: ``False``.
        reshard_after_forward: what a (non-root) unit keeps after its training forward: ``True`` frees its
            gathered parameters (backward gathers them again over the shard group), ``False`` keeps them until
            its backward, an int ``k`` keeps a copy sharded over groups of ``k`` consecutive ranks of the shard
            group (a node: ``k`` = ranks per node), from which backward gathers inside the group alone (FSDP2's
            ``reshard_after_forward=<int>``): between forward and backward each unit holds ``1/k`` of its
            gathered size. ``k`` must divide the shard group size (``k`` equal to it is ``True``, ``1`` is
            ``False``). ``None`` (default) follows ``sharding_strategy``: ``True`` for FULL_SHARD and
            HYBRID_SHARD, ``False`` for SHARD_GRAD_OP and HYBRID_SHARD_ZERO2. The root unit follows
            ``reshard_root_after_forward``. Change it between steps with ``flatshard.set_reshard_after_forward``.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding. Default: ``False``.
        param_init_fn: for a module built on the meta device: called with each module that holds meta
            parameters or buffers, after their storage is allocated on ``device``; it must initialize them in
            place. Default: ``None`` (inside a Hugging Face model its ``_init_weights`` for the buffers, the
            parameters left for ``load_pretrained``; else the module's own ``reset_parameters()``). Modules are
            materialized one unit at a time, right before the unit is sharded (see [Note: materializing unit
            by unit]), so the whole model never exists unsharded; a tensor nothing fills is refused at the
            first forward (see [Note: unfilled tensors]).
        process_group: the ranks to shard over. Default: all ranks (``None``: the default group). For hybrid
            strategies: a ``(shard_group, replicate_group)`` tuple or a 2-D ``DeviceMesh`` (replicate, shard).
        device_mesh: hybrid strategies: ``(replicas, ranks per shard group)`` or a 2-D ``DeviceMesh`` (dim 0
            replicates, dim 1 shards), instead of ``process_group`` or ``shard_group_size``. For a model
            parallelized with torch's ``parallelize_module`` (DTensor parameters), the whole ``DeviceMesh``: its
            last dimension is the tensor-parallel one the model was parallelized over and the others are the
            data-parallel one, ``("data_parallel", "tensor_parallel")`` (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD; see
            [Note: tensor parallelism]). Default: ``None``.
        shard_group_size: hybrid strategies: ranks per shard group (consecutive ranks; must divide the world
            size). Default: ``LOCAL_WORLD_SIZE`` (shard within a node).
        device: where shards and compute live. Default: the accelerator the module is on; else the current
            CUDA device when the backend includes NCCL (or is left to torch, for a meta-device model); else CPU.
        desync_timeout: seconds without progress after which ranks whose collectives no longer pair up (a
            rank skipped a forward, ran another unit, or waits in a collective of its own) raise
            ``DesyncError`` naming where each rank waits, instead of hanging until the process group's
            timeout; see [Note: finding a desync]. A slow rank is never reported. ``None``: never report.
            Per root: it applies to the collectives on the root's process groups (two roots on one group: the
            last ``shard()`` call's value); ``FLATSHARD_DESYNC_TIMEOUT`` overrides every root's.
            Default: 60.
        whole_tensor_optimizers: optimizer classes (or import paths) that need each parameter whole, as
            Shampoo-style preconditioners do: each such parameter is made whole on one owner rank for the step
            (see [Note: whole-tensor optimizers]). ``torch.optim.Muon`` and ``torch.optim.Adafactor`` are
            recognised without it. Default: ``()``.
    """

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_policy: Policy | None = None
    activation_checkpointing_policy: CheckFn | None = None
    activation_checkpointing_mode: CheckpointMode = "full"
    mixed_precision: MixedPrecision | None = None
    cpu_offload: bool | str = False
    activation_offload: bool = False
    limit_all_gathers: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    reshard_root_after_forward: bool = False
    reshard_after_forward: bool | int | None = None
    sync_module_states: bool = False
    param_init_fn: Callable[[nn.Module], None] | None = None
    process_group: Any = None
    device_mesh: Any = None
    shard_group_size: int | None = None
    device: torch.device | None = None
    desync_timeout: float | None = 60.0
    whole_tensor_optimizers: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        errors = OptionErrors("ShardOptions")
        normalized = {
            "sharding_strategy": errors.check(normalize_sharding_strategy, self.sharding_strategy),
            "auto_wrap_policy": errors.check(resolve_policy, self.auto_wrap_policy),
            "activation_checkpointing_policy": errors.check(
                resolve_checkpointing_policy, self.activation_checkpointing_policy
            ),
            "activation_checkpointing_mode": errors.check(
                _check_checkpointing_mode,
                self.activation_checkpointing_mode,
                self.activation_checkpointing_policy,
            ),
            "mixed_precision": errors.check(normalize_mixed_precision, self.mixed_precision),
            "cpu_offload": errors.check(normalize_cpu_offload, self.cpu_offload),
            "activation_offload": errors.check(_check_bool, "activation_offload", self.activation_offload),
            "limit_all_gathers": errors.check(_check_bool, "limit_all_gathers", self.limit_all_gathers),
            "backward_prefetch": errors.check(normalize_backward_prefetch, self.backward_prefetch),
            "forward_prefetch": errors.check(_check_bool, "forward_prefetch", self.forward_prefetch),
            "reshard_root_after_forward": errors.check(
                _check_reshard_root, self.reshard_root_after_forward, self.sharding_strategy
            ),
            "reshard_after_forward": errors.check(
                check_reshard_after_forward, self.reshard_after_forward, self.sharding_strategy
            ),
            "sync_module_states": errors.check(_check_bool, "sync_module_states", self.sync_module_states),
            "param_init_fn": errors.check(_check_param_init_fn, self.param_init_fn),
            "device_mesh": errors.check(_check_device_mesh, self.device_mesh),
            "shard_group_size": errors.check(_check_shard_group_size, self.shard_group_size),
            "device": errors.check(_check_device, self.device),
            "desync_timeout": errors.check(_check_desync_timeout, self.desync_timeout),
            "whole_tensor_optimizers": errors.check(
                _check_whole_tensor_optimizers, self.whole_tensor_optimizers
            ),
        }
        errors.raise_if_any()
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def offload_params(self) -> bool:
        """Shards, gradient shards and optimizer state in host memory (``cpu_offload=True``)."""
        return self.cpu_offload is True

    @property
    def offload_optimizer(self) -> bool:
        """Only the optimizer state in host memory (``cpu_offload="optimizer"``)."""
        return self.cpu_offload == OFFLOAD_OPTIMIZER
