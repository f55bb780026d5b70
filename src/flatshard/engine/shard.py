"""``shard()``: the engine's entry point. Plans units, builds flat parameters, registers hooks, in place."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.checkpointing import (
    CheckFn,
    apply_activation_checkpointing,
    resolve_checkpointing_policy,
)
from flatshard.engine.config import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    normalize_backward_prefetch,
    normalize_cpu_offload,
    normalize_mixed_precision,
    normalize_sharding_strategy,
)
from flatshard.engine.handle import FlatParamHandle
from flatshard.engine.materialize import ParamInitFn, has_meta_tensors, materialize_modules, materialize_unit
from flatshard.engine.precision import (
    UnitPrecision,
    cast_buffers,
    full_precision_modules,
    keep_full_precision,
)
from flatshard.engine.process_groups import resolve_groups
from flatshard.engine.runtime import STATE_ATTR, UnitState, get_unit_state
from flatshard.engine.wrap import PolicyLike, plan_units, resolve_policy, select_unit_modules

__all__ = ["is_sharded", "no_sync", "shard", "unit_states"]


def _default_device(group: Any | None) -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(
    module: nn.Module,
    *,
    sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    auto_wrap_policy: PolicyLike = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    process_group: Any | None = None,
    device: torch.device | str | int | None = None,
    sync_module_states: bool = False,
    mixed_precision: MixedPrecision | Mapping[str, Any] | None = None,
    cpu_offload: CPUOffload | bool | None = None,
    limit_all_gathers: bool = True,
    backward_prefetch: BackwardPrefetch | str | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    activation_checkpointing_policy: Any = None,
    param_init_fn: ParamInitFn | None = None,
    shard_group_size: int | None = None,
) -> nn.Module:
    """Shard ``module`` in place over the ranks of ``process_group`` and return it.

    The module keeps its class, its parameter names and its ``Parameter`` objects; each parameter's data
    becomes this rank's piece of its unit's flat parameter (see ``flatshard.engine.handle``). Forward and
    backward hooks gather each unit just in time and reduce-scatter its gradients.

    Args:
        module: the module to shard; it is the root unit. Submodules sharded by earlier ``shard()`` calls
            are kept as they are (manual nesting: shard inner modules first).
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"``
            (FULL_SHARD inside shard groups, replicated across them) or ``"HYBRID_SHARD_ZERO2"``
            (SHARD_GRAD_OP inside); see [Note: hybrid groups].
        auto_wrap_policy: which submodules become units of their own: ``None`` (default, only the root),
            a set of module classes (or import paths), an int (minimum parameters per unit), or a callable
            ``(module, recurse, nonwrapped_numel) -> bool`` (torch FSDP's policy contract).
        ignored_modules: modules whose parameters are left alone (not sharded, gradients not reduced).
        process_group: the ranks to shard over. Default: all ranks (``None``: the default group). For hybrid
            strategies: a ``(shard_group, replicate_group)`` tuple or a 2-D ``DeviceMesh`` (replicate, shard).
        shard_group_size: hybrid strategies: ranks per shard group (consecutive ranks; must divide the world
            size). Default: ``LOCAL_WORLD_SIZE`` (shard within a node).
        device: where shards and compute live. Default: the current CUDA device with NCCL, else CPU.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding. Default: ``False``.
        backward_prefetch: when to issue the next unit's all-gather in backward: ``"BACKWARD_PRE"``
            (default: before the current unit's gradient computation, more overlap), ``"BACKWARD_POST"``
            (after it, less memory) or ``None``.
        forward_prefetch: issue the next unit's all-gather before the current unit's forward compute.
            Default: ``False``.
        limit_all_gathers: rate-limit all-gathers so at most two unsharded buffers are pending
            (see ``flatshard.engine.limiter``; CUDA only, CPU work is synchronous). Default: ``True``.
        activation_checkpointing_policy: which submodules recompute their activations in backward instead
            of keeping them (see [Note: activation checkpointing]): module classes or their import paths,
            an int (modules with at least that many parameters), a callable ``module -> bool`` or a torch-
            FSDP-style policy callable. The outermost matching modules are checkpointed (non-reentrant);
            parameter names and checkpoints do not change. Default: ``None``.
        mixed_precision: a :class:`MixedPrecision` (or a mapping of its fields, dtypes as strings like
            ``"bf16"``): gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, keep
            fp32 shards for the optimizer and checkpoints (see [Note: mixed precision]). Batch-norm
            modules become units of their own in full precision. Default: ``None``.
        cpu_offload: ``True`` or ``CPUOffload(offload_params=True)``: shards and gradient shards in CPU
            memory (pinned with CUDA compute), so the optimizer steps on CPU; each unit is copied to the
            compute device for its gather (see [Note: CPU offload]). Default: ``None`` (no offload).
        param_init_fn: for a module built on the meta device: called with each module that holds meta
            parameters, after their storage is allocated on ``device``; it must initialize them in place.
            Default: ``None`` (the module's own ``reset_parameters()``). Modules are materialized one unit
            at a time, right before the unit is sharded (see [Note: materializing unit by unit]), so the
            whole model never exists unsharded.

    Returns:
        ``module`` itself.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}.")
    if get_unit_state(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded. HINT: call shard() once per module; to nest, "
            "shard inner modules first and the outer module last."
        )
    strategy = normalize_sharding_strategy(sharding_strategy)
    mp = normalize_mixed_precision(mixed_precision)
    offload = normalize_cpu_offload(cpu_offload)
    prefetch = normalize_backward_prefetch(backward_prefetch)
    for arg, value in (("limit_all_gathers", limit_all_gathers), ("forward_prefetch", forward_prefetch)):
        if not isinstance(value, bool):
            raise TypeError(f"{arg} must be a bool, got {type(value).__name__}: {value!r}.")
    policy = resolve_policy(auto_wrap_policy)
    checkpoint_check = resolve_checkpointing_policy(activation_checkpointing_policy)
    ignored = _expand_ignored(module, ignored_modules)
    shard_group, replicate_group = resolve_groups(strategy, process_group, shard_group_size)
    target = torch.device(device) if device is not None else _default_device(shard_group)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            f"param_init_fn must be a callable taking a module, got {type(param_init_fn).__name__}."
        )
    deferred = any(has_meta_tensors(m, recurse=False) for m in module.modules() if m not in ignored)
    if param_init_fn is not None and not deferred:
        warnings.warn(
            "shard(param_init_fn=...) was given but no parameter or buffer is on the meta device, so it is not "
            "called. HINT: build the model under torch.device('meta') (or trainer.init_module(empty_init=True)).",
            stacklevel=2,
        )

    finished = {m for m in module.modules() if m is not module and get_unit_state(m) is not None}
    # Only the outermost finished units matter: their subtrees are done.
    managed = {p for m in finished for s in [get_unit_state(m)] if s and s.handle for p in s.handle.params}
    _check_same_hybrid_groups(module, finished, strategy, shard_group, replicate_group)
    unit_modules = select_unit_modules(module, policy, ignored, finished)
    full_precision: list[nn.Module] = []  # batch norms: their parameters and buffers are never cast
    if mp is not None and (mp.param_dtype is not None or mp.buffer_dtype is not None):
        inside_finished = {sub for m in finished for sub in m.modules()}
        full_precision = [m for m in full_precision_modules(module, ignored) if m not in inside_finished]
        if mp.param_dtype is not None:  # units of their own, so their parameters are gathered uncast
            chosen = set(unit_modules) | set(full_precision)
            unit_modules = [m for m in module.modules() if m in chosen]
    plans = plan_units(module, unit_modules, ignored, finished, managed)
    names = {p: n for n, p in module.named_parameters(remove_duplicate=True)}
    sync_group = dist.group.WORLD if sync_module_states and dist.is_initialized() else None
    config = {
        "sharding_strategy": strategy,
        "process_group": process_group,
        "device": target,
        "ignored_modules": ignored,
        "backward_prefetch": prefetch,
        "forward_prefetch": forward_prefetch,
        "limit_all_gathers": limit_all_gathers,
        "mixed_precision": mp,
        "cpu_offload": offload,
    }
    for m in full_precision:
        keep_full_precision(m, next((p.dtype for p in m.parameters()), torch.float32))
    full_precision_set = set(full_precision)
    module_names = {m: n or "<root>" for n, m in module.named_modules()} if deferred else {}
    for plan in plans:
        handle = None
        param_names = [names.get(p, "?") for p in plan.params]
        if deferred:  # see [Note: materializing unit by unit]
            materialize_unit(plan, target, param_init_fn, module_names)
        if plan.params:
            handle = FlatParamHandle(
                plan.params,
                plan.aliases,
                param_names,
                shard_group,
                replicate_group,
                target,
                sync_group=sync_group,
                offload=offload,
                precision=UnitPrecision.resolve(
                    None if plan.module in full_precision_set else mp, plan.params[0].dtype
                ),
            )
        plan.module.__dict__[STATE_ATTR] = UnitState(plan.module, handle, strategy, config)
    if deferred:  # modules with meta buffers only
        materialize_modules(
            [m for m in module.modules() if m not in ignored], target, param_init_fn, module_names
        )
    _move_buffers(module, target, ignored, sync_group)
    cast_buffers(module, mp.buffer_dtype if mp is not None else None, ignored | set(full_precision))
    if checkpoint_check is not None:
        _checkpoint_inside_units(module, checkpoint_check, ignored)
    return module


def _check_same_hybrid_groups(
    root: nn.Module,
    finished: set[nn.Module],
    strategy: ShardingStrategy,
    shard_group: Any,
    replicate_group: Any,
) -> None:
    """Units under one root that use hybrid sharding must share their groups (see [Note: hybrid groups])."""
    names = {m: n for n, m in root.named_modules()}
    for m in finished:
        state = get_unit_state(m)
        if state is None or state.handle is None:
            continue
        inner = state.handle
        if not (strategy.is_hybrid or state.strategy.is_hybrid):
            continue
        if inner.shard_group is not shard_group or inner.replicate_group is not replicate_group:
            raise ValueError(
                f"{type(m).__name__} ({names.get(m, '?')!r}) was sharded with {state.strategy.name} over other process "
                f"groups than {strategy.name} here; every unit of a hybrid-sharded model must use the same shard and "
                "replicate groups. HINT: pass the same shard_group_size (or the same group tuple / DeviceMesh) to "
                "every shard() call."
            )


def _checkpoint_inside_units(root: nn.Module, check: CheckFn, ignored: set[nn.Module]) -> None:
    """Apply activation checkpointing and flag, for each checkpointed module, the unit owning it."""
    parents: dict[nn.Module, nn.Module] = {}
    for parent in root.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    for target in apply_activation_checkpointing(root, check, ignored):
        node: nn.Module | None = target
        while node is not None:
            state = get_unit_state(node)
            if state is not None:
                state.recompute_inside = True
                break
            node = parents.get(node)


def _expand_ignored(root: nn.Module, ignored_modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    if ignored_modules is None:
        return set()
    if isinstance(ignored_modules, nn.Module):
        ignored_modules = [ignored_modules]
    out: set[nn.Module] = set()
    tree = set(root.modules())
    for m in ignored_modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"ignored_modules must contain nn.Module objects, got {type(m).__name__}.")
        if m is root:
            raise ValueError(
                "ignored_modules contains the module being sharded itself; nothing would be sharded."
            )
        if m not in tree:
            raise ValueError(
                f"ignored_modules contains {type(m).__name__}, which is not inside the sharded module."
            )
        out.update(m.modules())
    return out


def _move_buffers(
    root: nn.Module, device: torch.device, ignored: set[nn.Module], sync_group: Any | None
) -> None:
    for m in root.modules():
        if m in ignored:
            continue
        for name, buf in m._buffers.items():
            if buf is None:
                continue
            if buf.device != device:
                buf = buf.to(device)
                m._buffers[name] = buf
            if sync_group is not None:
                dist.broadcast(buf, src=dist.get_global_rank(sync_group, 0), group=sync_group)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is a unit created by ``shard()``."""
    return get_unit_state(module) is not None


def unit_states(module: nn.Module) -> list[UnitState]:
    """Every unit at or below ``module``, in ``.modules()`` order."""
    return [s for m in module.modules() for s in [get_unit_state(m)] if s is not None]


@contextmanager
def no_sync(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced (gradient accumulation).

    [Note: no_sync]
    Each unit adds its flat gradient to an unsharded buffer of its own (in the gradient dtype) instead of
    reduce-scattering it; the first backward outside the context reduces the sum with its own gradient.
    Communication drops to one reduction per optimizer step; memory grows by one unsharded gradient per
    unit (the whole model's, as with DDP), kept between micro-batches. Without ``no_sync``, every
    micro-batch is reduce-scattered and the gradient shards accumulate: 1/world of that memory. Parameters'
    ``.grad`` is not updated inside the context. Call it on every rank, around the same backward passes.

    Args:
        module: a module sharded with :func:`shard` (every unit at or below it stops syncing).
        enabled: ``False`` makes the context a no-op (handy in accumulation loops).
    """
    states = unit_states(module)
    if not states:
        raise ValueError(
            f"no_sync needs a module sharded with flatshard.shard, and {type(module).__name__} is not one."
        )
    handles = [s.handle for s in states if s.handle is not None]
    previous = [h.sync_grads for h in handles]
    if enabled:
        for h in handles:
            h.sync_grads = False
    try:
        yield
    finally:
        for h, value in zip(handles, previous, strict=True):
            h.sync_grads = value
