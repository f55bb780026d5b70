"""``shard()``: the engine's entry point. Plans units, builds flat parameters, registers hooks, in place."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.calls.compile import seal_enclosing_forwards
from flatshard.engine.config import ShardingStrategy, ShardOptions, check_reshard_after_forward
from flatshard.engine.float8 import (
    Float8WeightConfig,
    Float8Weights,
    float8_weight_config,
    plain_float8_weights,
)
from flatshard.engine.handle import FlatParamHandle
from flatshard.engine.precision import (
    UnitPrecision,
    cast_buffers,
    full_precision_modules,
    keep_full_precision,
)
from flatshard.engine.runtime import ROOT_ATTR, STATE_ATTR, UnitState, get_unit_state, unit_states
from flatshard.engine.setup.activation_checkpointing import (
    CheckFn,
    CheckpointMode,
    apply_activation_checkpointing,
)
from flatshard.engine.setup.materialize import (
    Initializers,
    Materialized,
    has_meta_tensors,
    materialize_modules,
    materialize_unit,
)
from flatshard.engine.setup.process_groups import node_local_group, resolve_groups
from flatshard.engine.setup.wrap import Alias, plan_units, select_unit_modules
from flatshard.engine.step.whole_tensor import install_hooks, register_whole_tensor_optimizer
from flatshard.engine.tensor_parallel import (
    TensorParallelLayout,
    data_parallel_mesh,
    plain_tensor_parallel_params,
)
from flatshard.engine.transport import comm, memory, watchdog
from flatshard.engine.transport.env import check_environment
from flatshard.engine.transport.interface import Transport
from flatshard.engine.unfilled import BufferMark

__all__ = [
    "is_sharded",
    "no_sync",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_forward",
    "shard",
]


def _default_device(module: nn.Module, ignored: set[nn.Module], group: Any | None) -> torch.device:
    """Where shards and compute go when ``device`` is not given.

    An accelerator the module already lives on; else the current CUDA device when the group's backend
    includes NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``), or when it was left for torch to choose
    (``"undefined"``) and a model built on the meta device has no device of its own; else the CPU.
    """
    tensors = [
        t for m in module.modules() if m not in ignored for t in (*m.parameters(False), *m.buffers(False))
    ]
    placed = [t.device for t in tensors if not t.is_meta]
    accelerator = next((d for d in placed if d.type != "cpu"), None)
    if accelerator is not None:
        return accelerator
    undefined = comm.backend_name(group) == "undefined"
    if comm.uses_nccl(group) or (undefined and not placed and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(
    module: nn.Module,
    options: ShardOptions | None = None,
    /,
    *,
    ignored_modules: Iterable[nn.Module] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Shard ``module`` in place over the ranks of the shard group and return it.

    The module keeps its class, its parameter names and its ``Parameter`` objects; each parameter's data
    becomes this rank's piece of its unit's flat parameter (see ``flatshard.engine.handle``). Forward and
    backward hooks gather each unit just in time and reduce-scatter its gradients.

    Args:
        module: the module to shard; it is the root unit. Submodules sharded by earlier ``shard()`` calls
            are kept as they are (manual nesting: shard inner modules first).
        options: a :class:`~flatshard.engine.config.ShardOptions`. Default: ``ShardOptions()``.
        ignored_modules: modules whose parameters are left alone (not sharded, gradients not reduced).
        **kwargs: fields of :class:`~flatshard.engine.config.ShardOptions` (``sharding_strategy``,
            ``auto_wrap_policy``, ``mixed_precision``, ``cpu_offload``, ``device``, ...), given one by one;
            with ``options`` they replace its values.

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
    opts = _options(options, kwargs)
    install_hooks()  # see [Note: whole-tensor optimizers]
    for cls in opts.whole_tensor_optimizers:
        register_whole_tensor_optimizer(cls)
    check_environment()  # a malformed FLATSHARD_* fails here, see [Note: environment switches]
    strategy, mp, param_init_fn = opts.sharding_strategy, opts.mixed_precision, opts.param_init_fn
    ignored = _expand_ignored(module, ignored_modules)
    plain_float8_weights(module, ignored)  # see [Note: float8 all-gathers]
    layouts = plain_tensor_parallel_params(module, ignored)  # see [Note: tensor parallelism]
    shard_group, replicate_group, sync_group = _data_parallel_groups(opts, layouts)
    groups = [shard_group] + ([replicate_group] if replicate_group is not None else [])
    watchdog.configure(opts.desync_timeout, groups)  # this root's limit: see [Note: finding a desync]
    watchdog.start()
    target = opts.device if opts.device is not None else _default_device(module, ignored, shard_group)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    opts = replace(opts, device=target)
    finished = {m for m in module.modules() if m is not module and get_unit_state(m) is not None}
    # one transport for the model: the one of the units sharded before, if it serves these groups
    inner = [h.transport for s in map(get_unit_state, finished) if s is not None for h in s.handles]
    transport = next((t for t in inner if t.serves(shard_group, replicate_group, target)), None)
    transport = transport or Transport(shard_group, replicate_group, target)
    transport.connect()  # collective: every rank is in step here
    # A meta target is a dry run: nothing is materialized (see [Note: sharding on the meta device]).
    dry_run = target.type == "meta"
    deferred = not dry_run and any(
        has_meta_tensors(m, recurse=False) for m in module.modules() if m not in ignored
    )
    if param_init_fn is not None and not deferred and not dry_run:
        warnings.warn(
            "shard(param_init_fn=...) was given but no parameter or buffer is on the meta device, so it is not "
            "called. HINT: build the model under torch.device('meta') (or trainer.init_module(empty_init=True)).",
            stacklevel=2,
        )

    # Only the outermost finished units matter: their subtrees are done.
    managed = {p for m in finished for s in [get_unit_state(m)] if s for h in s.handles for p in h.params}
    _check_same_hybrid_groups(module, finished, strategy, shard_group, replicate_group)
    unit_modules = select_unit_modules(module, opts.auto_wrap_policy, ignored, finished)
    full_precision: list[nn.Module] = []  # batch norms: their parameters and buffers are never cast
    if mp is not None and (mp.param_dtype is not None or mp.buffer_dtype is not None):
        inside_finished = {sub for m in finished for sub in m.modules()}
        full_precision = [m for m in full_precision_modules(module, ignored) if m not in inside_finished]
        if mp.param_dtype is not None:  # units of their own, so their parameters are gathered uncast
            chosen = set(unit_modules) | set(full_precision)
            unit_modules = [m for m in module.modules() if m in chosen]
    plans = plan_units(module, unit_modules, ignored, finished, managed)
    names = {p: n for n, p in module.named_parameters(remove_duplicate=True)}
    if dist.is_initialized() and any(dist.get_world_size(g) > 1 for g in groups):
        for plan in plans:  # gradients are reduced across ranks: see [Note: dtypes on the wire]
            for p in plan.params:
                comm.check_trainable_dtype(names.get(p, "?"), p)
    for m in full_precision:
        keep_full_precision(m, next((p.dtype for p in m.parameters()), torch.float32))
    full_precision_set = set(full_precision)
    module_names = {m: n or "<root>" for n, m in module.named_modules()}
    inits = Initializers.of(module) if deferred else Initializers()
    made = Materialized()  # what nothing gave values: see [Note: unfilled tensors]
    keep_meta = sync_group is None  # else rank 0's values are broadcast into full storage
    all_handles: list[FlatParamHandle] = []
    for plan in plans:
        if deferred:  # see [Note: materializing unit by unit]
            materialize_unit(plan, target, param_init_fn, module_names, inits, made, keep_meta)
        handles = [
            FlatParamHandle(
                [plan.params[i] for i in members],
                [plan.aliases[i] for i in members],
                [names.get(plan.params[i], "?") for i in members],
                shard_group,
                replicate_group,
                target,
                sync_group=sync_group,
                offload=opts.offload_params,
                offload_optimizer=opts.offload_optimizer and not dry_run,  # a dry run allocates nothing
                precision=UnitPrecision.resolve(None if plan.module in full_precision_set else mp, dtype),
                unfilled=made.params,
                transport=transport,
                float8=Float8Weights(float8) if float8 else None,
                tensor_parallel=[layouts.get(id(plan.params[i])) for i in members] if layouts else (),
            )
            for (dtype, _), (members, float8) in _flat_groups(plan.params, plan.aliases).items()
        ]
        all_handles += handles
        unit = plan.module.__dict__[STATE_ATTR] = UnitState(plan.module, handles, opts)
        unit.path = module_names.get(plan.module, unit.path)
        if opts.reshard_after_forward is not None:
            _set_reshard(unit, opts.reshard_after_forward)
    if deferred:  # modules with meta buffers only
        materialize_modules(
            [m for m in module.modules() if m not in ignored],
            target,
            param_init_fn,
            module_names,
            inits,
            made,
            keep_meta,
        )
    _move_buffers(module, target, ignored, sync_group)
    if deferred or sync_group is not None:
        _record_unfilled(module, all_handles, made.buffers, sync_group)
    cast_buffers(module, mp.buffer_dtype if mp is not None else None, ignored | set(full_precision))
    if opts.activation_checkpointing_policy is not None:
        _checkpoint_inside_units(
            module, opts.activation_checkpointing_policy, ignored, opts.activation_checkpointing_mode
        )
    seal_enclosing_forwards(module)  # see [Note: torch.compile]
    top = get_unit_state(module)
    for m in module.modules():  # what register_forward_method looks up: see enclosing_units
        m.__dict__[ROOT_ATTR] = top
    memory.trim_heap()  # see [Note: returning the replaced parameters]
    return module


# [Note: sharding on the meta device]
# ``shard(module, device=torch.device("meta"))`` on a module built on the meta device is a dry run: every step of
# ``shard()`` runs as usual (unit planning, flat layouts, shards, hooks, activation checkpointing) but nothing is
# materialized and no tensor holds memory. Under a process group of torch's "fake" backend (collectives that move
# nothing) forward, backward and the optimizer step then run through the real hooks: the same gathers, frees,
# prefetches and reductions in the same order, with the same byte counts in ``comm_stats``, at any world size, in
# one process. ``flatshard.estimate`` measures memory and communication that way. Nothing computed on the meta
# device has values: it is for planning only.


def _data_parallel_groups(
    opts: ShardOptions, layouts: dict[int, TensorParallelLayout]
) -> tuple[Any | None, Any | None, Any | None]:
    """``(shard_group, replicate_group, sync_group)`` from the options; for a tensor-parallel model, groups of the
    data-parallel dimensions of ``device_mesh`` (see [Note: tensor parallelism])."""
    strategy, mesh = opts.sharding_strategy, opts.device_mesh
    tp_mesh = next(iter(layouts.values())).mesh if layouts else None
    if mesh is not None and opts.process_group is not None:
        raise ValueError("Give one of process_group, device_mesh, not both.")
    if tp_mesh is not None and mesh is None and opts.process_group is None:
        raise ValueError(
            "the model has tensor-parallel (DTensor) parameters, and shard() needs the data-parallel layout to "
            "shard them over. HINT: shard(model, device_mesh=mesh) with the mesh whose last dimension the model "
            "was parallelized over, e.g. init_device_mesh('cuda', (dp, tp), mesh_dim_names=('data_parallel', "
            "'tensor_parallel'))."
        )
    if tp_mesh is not None and strategy.is_hybrid:
        raise ValueError(
            f"sharding_strategy={strategy.name} with a tensor parallel model is not supported. HINT: use FULL_SHARD "
            "(or SHARD_GRAD_OP) over the data_parallel dimension of a (data_parallel, tensor_parallel) mesh."
        )
    whole = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if isinstance(mesh, tuple):  # (replicas, ranks per shard group)
        if tp_mesh is not None:
            raise ValueError(
                f"device_mesh={mesh} gives hybrid groups by size; a tensor-parallel model needs the DeviceMesh it "
                "was parallelized over. HINT: pass the DeviceMesh."
            )
        replicas, size = mesh
        if whole is not None and replicas * size != dist.get_world_size():
            raise ValueError(
                f"device_mesh={mesh} has {replicas * size} ranks but the world has {dist.get_world_size()}. HINT: "
                "(replicas, ranks per shard group) must multiply to the world size."
            )
        if not strategy.is_hybrid:
            raise ValueError(f"device_mesh={mesh} only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2.")
        shard_group, replicate_group = resolve_groups(strategy, None, size)
        return shard_group, replicate_group, (whole if opts.sync_module_states else None)
    if mesh is None:
        shard_group, replicate_group = resolve_groups(strategy, opts.process_group, opts.shard_group_size)
        sync = (
            opts.process_group if tp_mesh is not None and not isinstance(opts.process_group, tuple) else whole
        )
        return shard_group, replicate_group, (sync if opts.sync_module_states else None)
    data = data_parallel_mesh(mesh, tp_mesh)
    if data is None:  # tensor parallelism alone: nothing to shard over
        return None, None, None
    if data.ndim == 1:
        group: Any = data.get_group(0)
        if data.size() == 1:
            return None, None, None
        shard_group, replicate_group = resolve_groups(strategy, group, opts.shard_group_size)
        return shard_group, replicate_group, (group if opts.sync_module_states else None)
    shard_group, replicate_group = resolve_groups(strategy, data, opts.shard_group_size)
    return shard_group, replicate_group, (whole if opts.sync_module_states else None)


def _flat_groups(
    params: list[nn.Parameter], aliases: list[list[Alias]]
) -> dict[tuple[torch.dtype, bool], tuple[list[int], list[Float8WeightConfig]]]:
    """Positions of a unit's parameters per dtype, and float8-gathered weights apart (with their configs), in
    order of first appearance: one flat parameter each.

    [Note: a unit of several dtypes]
    A flat parameter holds one dtype, but a unit may hold several: a base model kept in bf16 under fp32
    adapters (LoRA), float8 weights beside bf16 norms. Such a unit gets one flat parameter per dtype, each
    sharded, gathered (in its own dtype, or the mixed-precision compute dtype), reduced and saved as any unit's
    is; the unit gathers all of them before its forward and frees them together. A frozen bf16 base then
    costs bf16 memory and bf16 all-gathers, and no gradient work (see [Note: reducing only what trains]).
    The gathers of one unit are issued back to back, so the rate limiter allows twice as many buffers in
    flight for a root holding such units (see [Note: rate limiter]).
    """
    groups: dict[tuple[torch.dtype, bool], tuple[list[int], list[Float8WeightConfig]]] = {}
    for i, p in enumerate(params):
        float8 = float8_weight_config(*aliases[i][0])  # see [Note: float8 all-gathers]
        members, configs = groups.setdefault((p.dtype, float8 is not None), ([], []))
        members.append(i)
        if float8 is not None:
            configs.append(float8)
    return groups


def _options(options: ShardOptions | None, kwargs: dict[str, Any]) -> ShardOptions:
    """``options`` with ``kwargs`` replacing its fields, validated once; unknown names get a hint."""
    if options is not None and not isinstance(options, ShardOptions):
        raise TypeError(
            f"shard()'s second argument is a ShardOptions, got {type(options).__name__}. HINT: pass options by "
            "keyword, e.g. shard(model, sharding_strategy='FULL_SHARD')."
        )
    unknown = sorted(set(kwargs) - set(ShardOptions.field_names()))
    if unknown:
        raise TypeError(
            f"shard() got unknown options {unknown}. HINT: the options are {', '.join(ShardOptions.field_names())} "
            "(and ignored_modules)."
        )
    if options is None:
        return ShardOptions(**kwargs)
    return replace(options, **kwargs) if kwargs else options


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
        if state is None or not state.handles:
            continue
        inner = state.handles[0]
        if not (strategy.is_hybrid or state.strategy.is_hybrid):
            continue
        if inner.shard_group is not shard_group or inner.replicate_group is not replicate_group:
            raise ValueError(
                f"{type(m).__name__} ({names.get(m, '?')!r}) was sharded with {state.strategy.name} over other process "
                f"groups than {strategy.name} here; every unit of a hybrid-sharded model must use the same shard and "
                "replicate groups. HINT: pass the same shard_group_size (or the same group tuple / DeviceMesh) to "
                "every shard() call."
            )


def _checkpoint_inside_units(
    root: nn.Module, check: CheckFn, ignored: set[nn.Module], mode: CheckpointMode
) -> None:
    """Apply activation checkpointing and flag, for each checkpointed module, the unit owning it."""
    parents: dict[nn.Module, nn.Module] = {}
    for parent in root.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    for target in apply_activation_checkpointing(root, check, ignored, mode):
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
                dist.broadcast(comm.as_wire(buf), src=dist.get_global_rank(sync_group, 0), group=sync_group)


def _record_unfilled(
    root: nn.Module, handles: list[FlatParamHandle], buffers: list[BufferMark], sync_group: Any | None
) -> None:
    """Keep what nothing gave values on the root unit and its handles, the same on every rank (with
    ``sync_module_states``, rank 0's lists: the others hold its broadcast values); a ``load_state_dict`` given
    one of those parameters fills it. See [Note: unfilled tensors]."""
    if sync_group is not None:
        lists: list[Any] = [[sorted(h.unfilled) for h in handles], [b.name for b in buffers]]
        dist.broadcast_object_list(lists, src=dist.get_global_rank(sync_group, 0), group=sync_group)
        for h, unfilled in zip(handles, lists[0], strict=True):
            h.unfilled = set(unfilled)
        buffers = []
        for name in lists[1]:
            path, _, attr = name.rpartition(".")
            holder = root.get_submodule(path)
            tensor = holder._buffers[attr]
            assert tensor is not None
            buffers.append(BufferMark(holder, attr, name, tensor, tensor._version))
    state = get_unit_state(root)
    assert state is not None
    state.unfilled_buffers = buffers
    watched: dict[nn.Module, list[tuple[str, FlatParamHandle, int]]] = {}
    for h in handles:
        for i in h.unfilled:
            for holder, attr in h.aliases[i]:
                watched.setdefault(holder, []).append((attr, h, i))
    for holder, entries in watched.items():
        holder.register_load_state_dict_pre_hook(functools.partial(_filled_by_load, entries))


def _filled_by_load(
    entries: list[tuple[str, FlatParamHandle, int]], module: nn.Module, state_dict: Any, prefix: str, *_: Any
) -> None:
    for attr, handle, i in entries:
        if prefix + attr in state_dict:
            handle.mark_filled(i)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is a unit created by ``shard()``."""
    return get_unit_state(module) is not None


@contextmanager
def no_sync(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced (gradient accumulation).

    [Note: no_sync]
    Each unit adds its flat gradient to an unsharded buffer of its own (in the gradient dtype) instead of
    reduce-scattering it; the first backward outside the context reduces the sum with its own gradient.
    Communication drops to one reduction per optimizer step; memory grows by one unsharded gradient per
    unit (the whole model's, as with DDP; of its trainable parameters only, see [Note: reducing only what
    trains]), kept between micro-batches. Without ``no_sync``, every
    micro-batch is reduce-scattered and the gradient shards accumulate: 1/world of that memory. Parameters'
    ``.grad`` is not updated inside the context. Call it on every rank, around the same backward passes.

    Under hybrid sharding the gradient is still reduce-scattered inside the shard group (gradient memory stays
    the shard's) and only the reduction across replicas waits for the backward outside the context (see
    [Note: replica reductions once per step]).

    Args:
        module: a module sharded with :func:`shard` (every unit at or below it stops syncing).
        enabled: ``False`` makes the context a no-op (handy in accumulation loops).
    """
    states = unit_states(module)
    if not states:
        raise ValueError(
            f"no_sync needs a module sharded with flatshard.shard, and {type(module).__name__} is not one."
        )
    handles = [h for s in states for h in s.handles]
    previous = [h.sync_grads for h in handles]
    if enabled:
        for h in handles:
            h.sync_grads = False
    try:
        yield
    finally:
        for h, value in zip(handles, previous, strict=True):
            h.sync_grads = value


def _units_for(module: nn.Module, recurse: bool, what: str) -> list[UnitState]:
    """``module``'s own unit (``recurse=False``) or every unit at or below it."""
    states = unit_states(module) if recurse else [s for s in [get_unit_state(module)] if s is not None]
    if not states:
        raise ValueError(
            f"{what} needs a module sharded with flatshard.shard"
            + (" that is a unit itself (recurse=False)" if not recurse and unit_states(module) else "")
            + f", and {type(module).__name__} is not one. HINT: pass the sharded model (or one of its units)."
        )
    return states


def set_requires_gradient_sync(
    module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True
) -> None:
    """Whether the next backward passes reduce gradients (``False``: accumulate them, as inside ``no_sync``).

    The persistent form of :func:`no_sync`, per unit, as FSDP2's method of that name: set it between
    steps, on every rank alike (from a training loop, a Fabric loop or a Trainer callback). ``False`` keeps
    each unit's gradient unsharded until a backward with ``True`` reduces the sum; under hybrid sharding the
    gradient is still reduce-scattered inside the shard group and only the reduction across replicas waits
    (see [Note: replica reductions once per step]).

    Args:
        module: a sharded model, or one of its units.
        requires_gradient_sync: reduce (``True``, the default state) or accumulate.
        recurse: every unit at or below ``module`` (default), or ``module``'s own unit only.
    """
    for state in _units_for(module, recurse, "set_requires_gradient_sync"):
        for h in state.handles:
            h.sync_grads = bool(requires_gradient_sync)


def set_requires_all_reduce(module: nn.Module, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """Under hybrid sharding, whether the next backward passes all-reduce gradients across replicas.

    ``False`` reduce-scatters each backward's gradient inside the shard group only and adds it to a partial
    sum of the shard's size; the next backward with ``True`` all-reduces the total once (see [Note: replica
    reductions once per step]). The Trainer's ``accumulate_grad_batches`` sets it for the micro-batches. No
    effect on units without replicas. As FSDP2's method of that name; set it on every rank alike.

    Args:
        module: a sharded model, or one of its units.
        requires_all_reduce: all-reduce across replicas (``True``, the default state) or wait.
        recurse: every unit at or below ``module`` (default), or ``module``'s own unit only.
    """
    for state in _units_for(module, recurse, "set_requires_all_reduce"):
        for h in state.handles:
            h.all_reduce_grads = bool(requires_all_reduce)


def _set_reshard(unit: UnitState, value: bool | int | None) -> None:
    """Resolve ``reshard_after_forward`` for one unit against its shard group (see [Note: a node-local copy
    for backward]); an int needs the groups of ``k`` ranks, made here (collective: every rank alike)."""
    value = check_reshard_after_forward(value)
    if value is None:
        value = unit.strategy.reshard_after_forward
    world = max((h.shard_world for h in unit.handles), default=1)
    group = None
    if not isinstance(value, bool):
        if world % value:
            raise ValueError(
                f"reshard_after_forward={value} does not divide the shard group size {world} of {unit.path}. "
                f"HINT: use a divisor of {world} (the ranks per node), True or False."
            )
        if value in (1, world):  # keep everything / keep nothing
            value = value == world
        else:
            group = node_local_group(unit.handles[0].shard_group, value)
    unit.reshard_after_forward, unit.node_group = value, group


def set_reshard_after_forward(module: nn.Module, value: bool | int | None, *, recurse: bool = True) -> None:
    """What units keep after their training forward from now on: ``True`` nothing, ``False`` their gathered
    parameters, an int ``k`` a copy sharded over ``k`` ranks that backward gathers inside that group; ``None``
    what the sharding strategy does. As ``shard(reshard_after_forward=...)`` and FSDP2's method of that name.

    Call it between steps, on every rank alike (an int makes process groups the first time). The root unit
    keeps following ``reshard_root_after_forward``.

    Args:
        module: a sharded model, or one of its units.
        value: ``True``, ``False``, an int dividing the shard group size, or ``None``.
        recurse: every unit at or below ``module`` (default), or ``module``'s own unit only.
    """
    for state in _units_for(module, recurse, "set_reshard_after_forward"):
        _set_reshard(state, value)
