"""One dry run: the model sharded on the meta device at one world size, two training steps, measured.

See [Note: estimating a step] in ``flatshard.estimator.api`` for what is measured and how it becomes an
estimate; this module only runs and measures.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine import (
    ShardOptions,
    UnitLayout,
    activation_offload_stats,
    comm_stats,
    gathered_buffers,
    group_traffic,
    is_whole_tensor_optimizer,
    original_shapes,
    shard,
    timeline,
    unit_layouts,
    unit_states,
    whole_tensor_owners,
)
from flatshard.estimator.options import EstimateOptions
from flatshard.estimator.target import EstimateError, build, training_step
from flatshard.estimator.tensor_parallel import TensorParallelTraffic, apply_plan, make_mesh
from flatshard.estimator.tracker import StorageTracker

__all__ = ["Collective", "Measured", "dry_run", "itemsize", "make_optimizer"]

META = torch.device("meta")


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device=META).element_size()


class Collective:
    """A collective of the measured step, placed between compute: issued after ``issue_flops`` of the step's
    floating-point work, waited for before ``wait_flops`` of it (``None``: at the end of the step)."""

    __slots__ = ("issue_flops", "kind", "nbytes", "wait_flops")

    def __init__(self, kind: str, nbytes: int, issue_flops: int, wait_flops: int | None) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.issue_flops = issue_flops
        self.wait_flops = wait_flops


@dataclass
class Measured:
    """What one dry run found, per rank (rank 0 of the shard group; see [Note: estimating a step])."""

    world: int
    shard_group_size: int | None
    layouts: list[UnitLayout]
    params: int  # shard bytes
    grads: int  # gradient shard bytes (the largest over the shard group's ranks)
    optimizer: int  # optimizer state bytes (the largest over ranks)
    optimizer_note: str = ""
    buffers: int = 0  # module buffers (replicated)
    gathered_max: int | None = None  # with a batch: the most gathered-parameter bytes alive at once
    activations: int | None = None  # with a batch: bytes held from the end of forward for backward
    peak: int | None = None  # with a batch: the measured peak of the step
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)  # bytes this rank sent per collective kind
    # bytes this rank sent per process group in the measured step: (role, the group's global ranks, bytes per
    # collective kind), role "shard", "replicate", "node" (reshard_after_forward=k's groups) or "tensor_parallel"
    # (DTensor's collectives: see [Note: estimating tensor parallelism])
    group_bytes: list[tuple[str, tuple[int, ...], dict[str, int]]] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    flops: int = 0
    # activation_offload: bytes each unit's saved activations held in the measured step (see [Note: activation
    # offload]; on the meta device the hooks run without copies, with a GPU's size threshold)
    offloaded_units: dict[str, int] = field(default_factory=dict)
    # with a batch and ``log_allocations``: the step's allocations in order (see StorageTracker.allocations)
    allocations: list[tuple[int, int, bool]] = field(default_factory=list)


def make_optimizer(
    spec: str | type, module: nn.Module, layouts: list[UnitLayout]
) -> tuple[torch.optim.Optimizer | None, int, str]:
    """The optimizer to step in the dry run, plus state bytes it cannot make there (Muon: whole momentum on
    owner ranks, computed from the owner plan), plus a note for the report."""
    params = [p for p in module.parameters() if p.requires_grad]
    if spec == "none" or not params:
        return None, 0, "no optimizer"
    if spec in ("adamw", "adam"):
        cls = torch.optim.AdamW if spec == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-3, foreach=False), 0, ""
    if spec == "sgd":
        return torch.optim.SGD(params, lr=1e-3), 0, ""
    if spec == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False), 0, ""
    if spec == "muon":
        return _muon(module, layouts)
    assert isinstance(spec, type)
    try:
        opt = spec(params)
    except TypeError:
        opt = spec(params, lr=1e-3)
    if is_whole_tensor_optimizer(opt):
        raise EstimateError(
            f"optimizer {spec.__name__} needs whole tensors (see flatshard's whole-tensor optimizers); the estimate "
            "cannot run its step without values. HINT: use --optimizer muon for Muon, or estimate with adamw and "
            "add the optimizer's state per parameter yourself."
        )
    return opt, 0, ""


def _muon(module: nn.Module, layouts: list[UnitLayout]) -> tuple[torch.optim.Optimizer | None, int, str]:
    """AdamW for embeddings, norms and biases; Muon's momentum for the other matrices, whole on their owners.

    Returns the AdamW part (stepped in the dry run) and the busiest rank's Muon state: per owned matrix its
    momentum and the owner's copy of the value (see [Note: whole-tensor optimizers]), the same plan in every
    shard group. A shard group of one rank holds every matrix whole already: the momentum alone.
    """
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    with original_shapes(module):
        shapes = {id(p): torch.Size(p.shape) for p in module.parameters()}
    trainable = [p for p in module.parameters() if p.requires_grad]
    muon = [p for p in trainable if len(shapes[id(p)]) == 2 and id(p) not in embedded]
    chosen = {id(p) for p in muon}
    rest = [p for p in trainable if id(p) not in chosen]
    sizes = [int(shapes[id(p)].numel()) * p.element_size() for p in muon]
    world = max((L.shard_world for L in layouts), default=1)
    if world > 1:
        load = [0] * world
        for size, owner in zip(sizes, whole_tensor_owners([shapes[id(p)] for p in muon], world), strict=True):
            load[owner] += 2 * size
        whole = max(load)
    else:
        whole = sum(sizes)
    opt = torch.optim.AdamW(rest, lr=1e-3, foreach=False) if rest else None
    note = f"Muon on {len(muon)} matrices (momentum whole on owner ranks), AdamW on {len(rest)} other tensors"
    return opt, whole, note


def _state_bytes(opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    seen: set[int] = set()
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v.untyped_storage()) not in seen:
                seen.add(id(v.untyped_storage()))
                total += v.untyped_storage().nbytes()
    return total


def _elementwise_state_bytes(spec: str | type, layouts: list[UnitLayout]) -> int:
    """State bytes of an elementwise optimizer on rank 0, from the layout (no step needed)."""
    copies = {"adamw": 2, "adam": 2, "sgd-momentum": 1}.get(spec if isinstance(spec, str) else "", 0)
    total = 0
    for L in layouts:
        for i, trains in enumerate(L.trainable):
            if trains:
                total += copies * L.piece_numels(i)[0] * itemsize(L.param_dtype)
    return total


def _grad_bytes(layouts: list[UnitLayout]) -> int:
    worlds = max((L.shard_world for L in layouts), default=1)
    return max(
        sum(L.grad_numel(min(r, L.shard_world - 1)) * itemsize(L.grad_dtype) for L in layouts)
        for r in range(worlds)
    )


def _storage_ids(tensors: list[torch.Tensor]) -> set[int]:
    return {id(t.untyped_storage()) for t in tensors}


def _engine_blocks(layouts: list[UnitLayout], param_ids: set[int]) -> Callable[[torch.UntypedStorage], bool]:
    """Which storages of the step the engine allocates as flat blocks, each a mapping of its own on CPU (see [Note:
    huge pages for CPU buffers]): the shards (sharded over ranks) and the buffers of a unit's flat sizes (gathered
    parameters, gradients to reduce, gradient shards, casts). The rest comes from the C allocator."""
    sizes = set()
    for L in layouts:
        for dtype in {L.param_dtype, L.compute_dtype, L.reduce_dtype, L.grad_dtype}:
            for numel in (L.padded_numel, L.shard_numel, L.reduce_chunk):
                sizes.add(numel * itemsize(dtype))
    sharded = any(L.shard_world > 1 for L in layouts)

    def is_block(st: torch.UntypedStorage) -> bool:
        if id(st) in param_ids:
            return sharded  # a single rank's shard is an ordinary tensor
        return int(st.nbytes()) in sizes

    return is_block


_reference_attention = torch.nn.functional.scaled_dot_product_attention


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention on the meta device as the devices run it.

    [Note: attention in the dry run]
    On the meta device ``scaled_dot_product_attention`` takes its reference path, which keeps the
    ``heads x seq x seq`` attention weights for backward; GPUs (flash or memory-efficient attention) and CPUs
    (their flash kernel) keep only the output and one value per row for 4-D inputs without a mask or dropout,
    grouped-query attention included (``enable_gqa``: the keys and values are not expanded). So
    during a dry run such calls go to the fused kernel's meta implementation, whose saved tensors are those of
    the real kernels; other calls keep the reference path, as they do on the devices.
    """
    fused = (
        query.is_meta
        and attn_mask is None
        and dropout_p == 0.0
        and query.dim() == key.dim() == value.dim() == 4
        and key.shape == value.shape
        and query.shape[-1] == key.shape[-1]
        and (key.shape[1] == query.shape[1] or (enable_gqa and query.shape[1] % key.shape[1] == 0))
    )
    if not fused:
        return _reference_attention(  # type: ignore[no-any-return]
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    return out  # type: ignore[no-any-return]


@contextmanager
def _attention_as_on_devices() -> Iterator[None]:
    """See [Note: attention in the dry run]."""
    functional = torch.nn.functional
    previous = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = previous


def dry_run(
    factory: Callable[[], Any],
    name: str,
    opts: EstimateOptions,
    world: int,
    group: int | None,
    log_allocations: bool = False,
) -> Measured:
    """Shard ``factory()``'s model on the meta device over a fake process group of ``world`` ranks (this process
    rank 0) and measure two training steps (the second one: see [Note: estimating a step]); with
    ``log_allocations``, keep the second step's allocations for a replay (see [Note: a rank's runtime])."""
    if dist.is_available() and dist.is_initialized():
        raise EstimateError(
            "the estimate runs its own (fake) process group, and this process already has one. HINT: call "
            "flatshard.estimate() before torch.distributed.init_process_group(), or use the `flatshard estimate` "
            "command."
        )
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    try:  # the fake group's state (its desync limit) goes with it: see [Note: state per process group]
        k = opts.tensor_parallel_size
        mesh = make_mesh(world, k) if k > 1 else None  # see [Note: estimating tensor parallelism]
        with _attention_as_on_devices():
            return _measure(factory, name, opts, world, group, log_allocations, mesh)
    finally:
        dist.destroy_process_group()


def _measure(
    factory: Callable[[], Any],
    name: str,
    opts: EstimateOptions,
    world: int,
    group: int | None,
    log_allocations: bool = False,
    mesh: Any = None,
) -> Measured:
    built = build(factory, name)
    module = built.module
    if mesh is not None:
        module = apply_plan(opts.tensor_parallel_plan, module, mesh, name)
    options: ShardOptions = replace(
        opts.shard,
        device=META,
        desync_timeout=None,
        shard_group_size=group,
        cpu_offload=False,  # offload is accounted from the layout: see [Note: estimating a step]
        sync_module_states=False,
        param_init_fn=None,
        device_mesh=mesh,
    )
    shard(module, options)
    layouts = unit_layouts(module)
    optimizer, whole_state, note = make_optimizer(opts.optimizer, module, layouts)
    buffers = sum(b.untyped_storage().nbytes() for b in module.buffers())
    params = sum(L.shard_numel * itemsize(L.param_dtype) for L in layouts)
    measured = Measured(
        world=world,
        shard_group_size=group,
        layouts=layouts,
        params=params,
        grads=_grad_bytes(layouts),
        optimizer=whole_state + (_elementwise_state_bytes(opts.optimizer, layouts) if optimizer else 0),
        optimizer_note=note,
        buffers=buffers,
    )
    if built.batch is None:
        return measured
    _checked_step(name, module, built.batch, optimizer)  # records the order, creates the optimizer state
    persistent = [p for p in module.parameters()] + [b for b in module.buffers()]
    persistent += [p.grad for p in module.parameters() if p.grad is not None]
    states = [
        v
        for s in (optimizer.state.values() if optimizer else [])
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    measured.optimizer = whole_state + _state_bytes(optimizer)  # what the step made, measured
    param_ids = _storage_ids([p for p in module.parameters()])
    state_ids = _storage_ids(states)
    tracker = StorageTracker(
        categories={
            "params": lambda st: id(st) in param_ids,
            "optimizer": lambda st: id(st) in state_ids,
        },
        count_flops=True,
        log=_engine_blocks(layouts, param_ids) if log_allocations else None,
    )
    tracker.watch(persistent + states)
    tracker.watch_resizable(gathered_buffers(module))
    del persistent, states  # holding the gradients here would keep zero_grad from freeing them
    comm_stats.clear()
    roles = _group_roles(module)
    sent_before = [dict(group_traffic(g)[1]) for _, g in roles]
    marks: dict[str, tuple[int, int]] = {}

    def mark(phase: str) -> None:
        marks[phase] = (tracker.live(), tracker.resizable_bytes())

    traffic = TensorParallelTraffic()
    with timeline() as records, tracker, traffic:
        tracker.reset_peak()
        mark("start")
        _checked_step(name, module, built.batch, optimizer, mark)
    measured.comm = {k: int(v) for k, v in comm_stats.items() if v}
    measured.group_bytes = []
    for (role, g), before in zip(roles, sent_before, strict=True):
        ranks, sent = group_traffic(g)
        kinds = {k: int(v - before.get(k, 0)) for k, v in sent.items() if v - before.get(k, 0)}
        measured.group_bytes.append((role, ranks, kinds))
    if mesh is not None:
        tp_group = mesh["tensor_parallel"].get_group(0)
        tp_ranks = tuple(dist.get_process_group_ranks(tp_group))
        measured.group_bytes.append(("tensor_parallel", tp_ranks, traffic.of(tp_group)))
    measured.gathered_max = tracker.resizable_peak
    live0, gathered0 = marks["start"]
    live1, gathered1 = marks["forward"]
    measured.activations = max(0, (live1 - gathered1) - (live0 - gathered0))
    offloaded = activation_offload_stats(module)
    if offloaded is not None and opts.shard.activation_offload:
        measured.offloaded_units = dict(offloaded.unit_bytes)
    measured.peak = tracker.peak + whole_state
    breakdown = dict(tracker.peak_breakdown)
    measured.peak_breakdown = breakdown
    measured.flops = tracker.flops
    measured.allocations = tracker.allocations
    times = [ns for ns, _ in tracker.trace]
    flops = [f for _, f in tracker.trace]

    def at(ns: int) -> int:
        i = bisect.bisect_right(times, ns) - 1
        return flops[i] if i >= 0 else 0

    measured.collectives = [
        Collective(r.kind, r.nbytes, at(r.issued_ns), at(r.waited[0][0]) if r.waited else None)
        for r in records
    ]
    comm_stats.clear()
    return measured


def _group_roles(module: nn.Module) -> list[tuple[str, Any]]:
    """This rank's process groups with more than one rank, by role: the shard group, the replicate group, and the
    node-local groups of ``reshard_after_forward=k``."""
    out: dict[int, tuple[str, Any]] = {}
    for state in unit_states(module):
        for h in state.handles:
            if h.shard_world > 1:
                out.setdefault(id(h.shard_group), ("shard", h.shard_group))
            if h.replicate_world > 1:
                out.setdefault(id(h.replicate_group), ("replicate", h.replicate_group))
        if state.node_group is not None:
            out.setdefault(id(state.node_group), ("node", state.node_group))
    return list(out.values())


def _checked_step(
    name: str,
    module: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer | None,
    mark: Callable[[str], None] | None = None,
) -> None:
    """:func:`training_step` on the meta device, its failures explained."""
    try:
        training_step(module, batch, optimizer, mark)
    except EstimateError:
        raise
    except Exception as err:
        raise EstimateError(
            f"the training step of {name}'s model failed on the meta device: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. HINT: the forward must not read tensor values "
            "(.item(), .tolist(), data-dependent shapes) and the batch must match the model's forward; to get the "
            "layout numbers without a step, return the model alone from the factory."
        ) from err
