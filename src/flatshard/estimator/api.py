"""``flatshard.estimate``: per-rank memory and step communication of a model on N ranks, before running it.

[Note: estimating a step]
Nothing here re-derives the engine's layout. For each world size the model is built on the meta device and
sharded by ``shard()`` itself, on the meta device, over a process group of torch's "fake" backend of that size
(this process is its rank 0; see [Note: sharding on the meta device]). Units, flat sizes, padding, shards,
mixed-precision dtypes, activation checkpointing and hybrid groups are then the engine's own, read back as
:class:`flatshard.engine.UnitLayout` records:

- parameters: the rank's shards; gradients: its gradient shards (the largest over the ranks of a shard group:
  with frozen parameters ranks differ); optimizer state: what the optimizer's step makes on the meta shards
  (AdamW: two tensors of the shard's dtype per trainable piece, SGD with momentum one, SGD none), except for
  Muon, whose momentum is whole on each matrix's owner rank: owners come from the engine's plan
  (:func:`flatshard.engine.whole_tensor_owners`), the busiest rank is reported, and the owner's copy of each
  whole value is counted with it.
- with an example batch, two training steps run in Lightning's order (forward and loss, ``zero_grad``,
  backward, optimizer step) through the real hooks: gathers, prefetches (recorded in the first step, used in
  the second), frees, recomputation, reductions. The second step is measured by a storage tracker (see [Note:
  what the memory tracker measures]): its peak, the most gathered-parameter bytes alive at once, and the
  activations (bytes the end of forward holds beyond its start, gathered parameters excepted). The
  communication bytes are the engine's own ``comm_stats`` of that step, so they are what a real rank counts.
  On the meta device every collective and every free completes in program order, as on CPU ranks; that is the
  ``device="cpu"`` estimate, and the one the measured checks compare with real gloo runs. Its peak adds the
  rank's runtime, measured in fresh processes (see [Note: a rank's runtime]), so it is the peak RSS the operating
  system reports; ``overhead`` given replaces the measurement.
- ``device="cuda"`` adds what a GPU holds beyond program order: the all-gather limiter lets the CPU free
  buffers the GPU still reads, at most two all-gathers ahead (see [Note: rate limiter]), so under FULL_SHARD
  the two largest non-root units' buffers are added ("allocator lag"; without ``limit_all_gathers``, every
  non-root unit's), and a fixed ``overhead`` for the CUDA context and the communication library (1 GiB by
  default). The caching allocator's fragmentation is not modelled.
- without an example batch there is no step to run: the gathered parameters in flight come from the schedule
  rules (FULL_SHARD: the root plus the two largest other units, current and prefetched; SHARD_GRAD_OP and
  copies under NO_SHARD: every unit, gathered from its forward to its backward), one unit's unsharded gradient
  is added for the reduction in flight, activations are not counted, and communication is counted per unit
  assuming each unit's forward runs once.
- CPU offload is accounted from the dry run without offload: shards, gradient shards and optimizer state move
  to host memory, and two shards' copies in the compute dtype (the per-gather copy to the device) are added.
  With ``cpu_offload="optimizer"`` only the optimizer state leaves the device; the host holds it and the host
  copies of each rank's trainable shard and gradient shard (see [Note: optimizer offload]). Neither is measured.

Every rank of a shard group holds the same shard sizes; rank 0 holds no padding, so its elementwise optimizer
state is the largest. Activations depend on the per-rank batch only, not on the world size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flatshard.engine import OptionErrors, ShardOptions, UnitLayout
from flatshard.estimator.dry_run import Measured, dry_run, itemsize
from flatshard.estimator.options import LINKS, EstimateOptions, Link, parse_bytes, parse_link
from flatshard.estimator.runtime import Replay, factory_path, measure_runtime
from flatshard.estimator.target import EstimateError, resolve_factory
from flatshard.estimator.tensor_parallel import resolve_plan
from flatshard.estimator.timing import collective_seconds, step_time

__all__ = ["Estimate", "RankEstimate", "estimate"]


@dataclass
class RankEstimate:
    """The estimate at one world size (and shard group size): bytes per rank, communication per step."""

    world_size: int
    shard_group_size: int | None
    units: int
    largest_unit: str
    largest_unit_numel: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    gathered: int  # gathered parameters alive at once (program order)
    allocator_lag: int  # CUDA: buffers freed by the CPU that the GPU still reads
    activations: int | None
    other_transient: int  # unsharded gradients in flight, casts, temporaries at the peak
    overhead: int
    peak: int
    host: int  # CPU offload: bytes in host memory
    measured: bool  # whether a step ran (an example batch was given)
    comm: dict[str, int]  # bytes this rank sends per step, by collective kind
    comm_by_group: dict[str, int]  # the same, by process group: "shard" / "replicate" / "node"
    wire: int  # bytes this rank puts on its links per step (ring collectives; see [Note: the communication time model])
    optimizer_exchange: int  # whole-tensor optimizers: bytes sent to and from owners per step (estimated)
    flops: int
    compute_s: float | None = None
    communication_s: float | None = None
    exposed_s: float | None = None
    step_s: float | None = None
    capacity: int | None = None
    notes: list[str] = field(default_factory=list)
    # device "cpu": what the rank's process holds beyond its tensors, measured (see [Note: a rank's runtime])
    runtime: int = 0
    runtime_parts: dict[str, int] = field(default_factory=dict)
    offload: bool | str = False  # the cpu_offload option: False, True or "optimizer"
    activations_host: int = 0  # activation_offload: the units' saved activations in host memory
    # the options this row was estimated with (the diagnosis does not suggest them again)
    checkpointing: str | None = None  # activation checkpointing: None (off), full, selective, operators
    activation_offload: bool = False
    device: str = "cuda"
    # per optimizer step of ``micro_batches`` micro-batches: the bytes this rank sends into groups whose ranks span
    # nodes of ``ranks_per_node`` (see [Note: bytes between nodes])
    micro_batches: int = 1
    ranks_per_node: int = 8
    cross_node: int = 0
    # tensor parallelism (see [Note: estimating tensor parallelism]): ranks per tensor-parallel group, and the bytes
    # this rank sends into it per step by collective kind (DTensor's collectives; ``comm`` holds the engine's own)
    tensor_parallel_size: int = 1
    tensor_parallel_comm: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= self.capacity

    @property
    def persistent(self) -> int:
        """Device bytes that stay between steps and shrink with more ranks (shards, gradient shards, optimizer
        state; with CPU offload only the gradient shards in flight to the host, with optimizer offload no optimizer
        state)."""
        if self.offload is True:
            return self.grads
        return self.params + self.grads + (0 if self.offload else self.optimizer)


@dataclass
class Estimate:
    """Everything :func:`estimate` found; ``rows`` one per world size (and shard group size)."""

    target: str
    options: dict[str, Any]
    rows: list[RankEstimate]

    def to_json(self) -> str:
        return json.dumps(
            {
                "target": self.target,
                "options": self.options,
                "rows": [dict(asdict(r), fits=r.fits) for r in self.rows],
            },
            indent=2,
        )

    def diagnosis(self) -> str | None:
        """Why nothing fits and what would, or ``None`` when some row fits (or no capacity is set)."""
        if not self.rows or any(r.fits is not False for r in self.rows):
            return None
        row = max(self.rows, key=lambda r: (r.world_size, -r.peak))
        return _diagnose(row)


def format_bytes(n: float | None) -> str:
    """``1.50 GiB``, ``12.00 MiB``, ``512 B``; ``-`` for ``None``."""
    if n is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_gib = format_bytes


def _diagnose(row: RankEstimate) -> str:
    cap = row.capacity or 0
    fixed = row.peak - row.persistent  # what more ranks do not shrink
    parts = [
        ("parameter shards", row.params),
        ("gradient shards", row.grads),
        ("optimizer state", row.optimizer),
        ("gathered units", row.gathered + row.allocator_lag),
        ("activations", row.activations or 0),
        ("other transient memory", row.other_transient),
        ("overhead", row.overhead),
        ("runtime", row.runtime),
    ]
    largest = max(parts, key=lambda p: p[1])
    lines = [
        f"the model does not fit in {_gib(cap)} per device even at {row.world_size} ranks: the peak is "
        f"{_gib(row.peak)} per rank, the largest part {largest[0]} ({_gib(largest[1])})."
    ]
    hints = []
    if row.persistent and fixed < cap:
        needed = math.ceil(row.world_size * row.persistent / (cap - fixed))
        hints.append(f"more ranks: about {needed} (the shards shrink with ranks; {_gib(fixed)} does not)")
    elif row.persistent:
        hints.append(
            f"more ranks alone cannot help: {_gib(fixed)} per rank does not shrink with ranks (gathered units, "
            "activations, overhead)"
        )
    hints += _offload_hints(row)
    if row.activations:
        hints += _activation_hints(row, row.activations)
    if row.gathered + row.allocator_lag > cap / 4:
        hints.append(
            f"smaller units (--wrap with finer classes): the largest unit, {row.largest_unit}, alone holds "
            f"{row.largest_unit_numel:,} parameters when gathered"
        )
    return " ".join(lines) + " HINT: " + "; ".join(hints) + "."


def _offload_hints(row: RankEstimate) -> list[str]:
    """``--cpu-offload`` and ``--cpu-offload optimizer``, where they move something not already moved."""
    if row.offload is True:
        return []
    if row.offload == "optimizer":
        if not row.params:
            return []
        return [
            f"--cpu-offload (not only the optimizer) moves the {_gib(row.params)} of parameter shards to host "
            "memory too"
        ]
    if not row.params + row.optimizer:
        return []
    moved = _gib(row.params + row.optimizer)
    hint = f"--cpu-offload moves {moved} of shards and optimizer state to host memory"
    if row.optimizer:
        hint += (
            f" (--cpu-offload optimizer: only the {_gib(row.optimizer)} of optimizer state, which the CPU then "
            "steps; shards and gradients stay on the device)"
        )
    return [hint]


def _activation_hints(row: RankEstimate, activations: int) -> list[str]:
    """Activation checkpointing, its full mode, activation offload (CUDA) and a smaller batch, where not in use."""
    amount = f"the {_gib(activations)} of activations"
    hints = []
    if row.checkpointing is None:
        hints.append(
            f"activation checkpointing shrinks {amount}: --checkpoint BlockClass keeps each block's input only "
            "(--activation-checkpointing-mode full, the default), --activation-checkpointing-mode selective also "
            "keeps matrix products and attention (more memory, less recomputation)"
        )
    elif row.checkpointing != "full":
        now = "a list of operators" if row.checkpointing == "operators" else row.checkpointing
        hints.append(
            f"--activation-checkpointing-mode full (now {now}) keeps only the checkpointed blocks' inputs of "
            f"{amount} and recomputes the rest"
        )
    if not row.activation_offload and row.device == "cuda":
        hints.append(
            "--activation-offload moves the units' saved activations to host memory, two units' stay on the "
            "device" + ("" if row.units > 1 else " (it needs units: --wrap)")
        )
    hints.append(f"a smaller per-rank batch shrinks {amount}")
    return hints


def _checkpointing(options: ShardOptions) -> str | None:
    if options.activation_checkpointing_policy is None:
        return None
    mode = options.activation_checkpointing_mode
    return mode if isinstance(mode, str) else "operators"


GroupBytes = list[
    tuple[str, tuple[int, ...], dict[str, int]]
]  # (role, rank 0's group's ranks, bytes per kind)


def _layout_comm(layouts: list[UnitLayout], reshard_root: bool) -> tuple[dict[str, int], GroupBytes]:
    """Bytes per rank per step from the layout, each unit's forward running once (see the module note): by
    collective kind, and by rank 0's process groups ("shard", "replicate", "node": consecutive ranks, as
    ``shard()`` makes them from a group size)."""
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    shard: dict[str, int] = {}
    node: dict[str, int] = {}
    replicate: dict[str, int] = {}

    def add(kinds: dict[str, int], kind: str, n: int) -> None:
        out[kind] += n
        kinds[kind] = kinds.get(kind, 0) + n

    for L in layouts:
        if L.shard_world > 1:
            size = itemsize(L.compute_dtype)
            again = L.reshard_after_forward and (not L.is_root or reshard_root)
            local = again and L.node_copy > 1 and not L.is_root  # backward gathers the node-local copy
            add(shard, "all_gather", L.shard_numel * size * (2 if again and not local else 1))
            if local:
                add(node, "all_gather", L.padded_numel // L.node_copy * size)
        if not any(L.trainable):
            continue
        chunk = L.reduce_chunk * itemsize(L.reduce_dtype)
        if L.shard_world > 1:
            add(shard, "reduce_scatter", chunk * L.shard_world)
        if L.replicate_world > 1:
            add(replicate, "all_reduce", chunk)
    s = max((L.shard_world for L in layouts), default=1)
    r = max((L.replicate_world for L in layouts), default=1)
    k = max((L.node_copy for L in layouts), default=0)
    groups: GroupBytes = [
        ("shard", tuple(range(s)), shard),
        ("replicate", tuple(range(0, s * r, s)), replicate),
        ("node", tuple(range(k)), node),
    ]
    return {kind: v for kind, v in out.items() if v}, [g for g in groups if g[2]]


def _ranks_per_node(opts: EstimateOptions, m: Measured) -> int:
    """Ranks per node: given, else a hybrid shard group, else 8 (or the world, when smaller)."""
    if opts.ranks_per_node:
        return opts.ranks_per_node
    if m.shard_group_size:
        return m.shard_group_size
    return min(8, m.world)


def _cross_node(groups: GroupBytes, micro_batches: int, rpn: int) -> int:
    """Bytes rank 0 puts on the links of groups whose ranks lie on more than one node, per optimizer step.

    [Note: bytes between nodes]
    Ranks ``r`` and ``s`` share a node when ``r // ranks_per_node == s // ranks_per_node`` (a launcher's
    consecutive ranks). What a rank puts on the links of a group of ``W`` ranks follows the ring algorithms (as
    [Note: the communication time model]): ``(W - 1)`` times its shard for an all-gather, ``(W - 1) / W`` of its
    input for a reduce-scatter, ``2 (W - 1) / W`` of it for an all-reduce; for a group spanning nodes all of it is
    counted as traffic between nodes (an upper bound: a ring over ``n`` nodes crosses ``n`` of its ``W`` links).
    Per optimizer step of ``k`` micro-batches every micro-batch gathers and reduce-scatters (the Trainer's default
    accumulation), while the all-reduce across replicas runs once (see [Note: replica reductions once per step]);
    the node-local groups of ``reshard_after_forward`` stay inside a node when their size is at most
    ``ranks_per_node``. The bytes each group is sent are the engine's own counts (``group_traffic``), checked
    against real ranks exactly.
    """
    total = 0.0
    for role, ranks, kinds in groups:
        if len({r // rpn for r in ranks}) < 2:
            continue
        total += _ring_bytes(kinds, len(ranks)) * (1 if role == "replicate" else micro_batches)
    return int(total)


def _ring_bytes(kinds: dict[str, int], w: int) -> float:
    """What a rank puts on the links of a ring of ``w`` ranks for bytes counted as ``comm_stats`` counts them (see
    [Note: bytes between nodes]); an all-to-all sends ``(w - 1) / w`` of its input."""
    return (
        kinds.get("all_gather", 0) * (w - 1)
        + (kinds.get("reduce_scatter", 0) + kinds.get("all_to_all", 0)) * (w - 1) / w
        + kinds.get("all_reduce", 0) * 2 * (w - 1) / w
    )


def _gathered_bytes(L: UnitLayout) -> int:
    return L.padded_numel * itemsize(L.compute_dtype) if L.gathers else 0


def _scheduled_gathered(layouts: list[UnitLayout], opts: ShardOptions) -> int:
    """Gathered bytes in flight by the schedule rules, without a step to measure (see the module note)."""
    root = sum(_gathered_bytes(L) for L in layouts if L.is_root)
    others = sorted((_gathered_bytes(L) for L in layouts if not L.is_root), reverse=True)
    if any(L.reshard_after_forward for L in layouts):
        prefetch = opts.backward_prefetch is not None or opts.forward_prefetch
        return root + sum(others[: 2 if prefetch else 1])
    return root + sum(others)


def _lag(layouts: list[UnitLayout], opts: ShardOptions, device: str) -> int:
    if device != "cuda" or not any(L.reshard_after_forward and L.shard_world > 1 for L in layouts):
        return 0
    others = sorted((_gathered_bytes(L) for L in layouts if not L.is_root), reverse=True)
    return sum(others[:2]) if opts.limit_all_gathers else sum(others)


def _exchange(layouts: list[UnitLayout], spec: str | type) -> int:
    """Muon: bytes a rank sends per step to and from owners, ``2 P (N-1) / N**2`` (see [Note: whole-tensor
    optimizers]), for the 2-D parameters of sharded units."""
    if spec != "muon":
        return 0
    total = 0
    for L in layouts:
        if L.shard_world > 1:
            n = L.shard_world
            numel = sum(
                int(s.numel()) for s, t in zip(L.shapes, L.trainable, strict=True) if t and len(s) == 2
            )
            total += int(2 * numel * (n - 1) / n**2) * itemsize(L.param_dtype)
    return total


def _wire(comm: dict[str, int], layouts: list[UnitLayout]) -> int:
    """What a rank sends on its links for ``comm_stats``-style counts: a ring all-gather sends ``(W-1)`` shards,
    a reduce-scatter ``(W-1)/W`` of its input, an all-reduce twice that."""
    shard = max((L.shard_world for L in layouts), default=1)
    replicate = max((L.replicate_world for L in layouts), default=1)
    sent = (shard - 1) * comm.get("all_gather", 0) + (shard - 1) / shard * comm.get("reduce_scatter", 0)
    sent += 2 * (replicate - 1) / replicate * comm.get("all_reduce", 0)
    return int(sent)


def _describe_precision(options: ShardOptions) -> str:
    mp = options.mixed_precision
    if mp is None:
        return "full precision"
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    compute = name.get(mp.param_dtype, str(mp.param_dtype)) if mp.param_dtype else "param dtype"
    reduce = mp.reduce_dtype or mp.param_dtype
    return f"compute {compute}, reduce {name.get(reduce, str(reduce)) if reduce else 'param dtype'}"


def _offload_activations(
    m: Measured, opts: EstimateOptions, activations: int | None, peak: int, notes: list[str]
) -> tuple[int | None, int, int]:
    """``activation_offload``: the units' saved activations wait in host memory; two units' stay on the device
    (the unit computing and the one in flight or prefetched: see [Note: activation offload]), and so does what
    the root saves after its last unit. Derived from the measured step's per-unit bytes; the peak is taken to
    hold every activation, as at the start of backward. Returns the device activations, the peak, the host
    bytes."""
    if not opts.shard.activation_offload:
        return activations, peak, 0
    if opts.device == "cpu":
        notes.append("activation offload: no effect on a CPU device (activations are in host memory already)")
        return activations, peak, 0
    if activations is None:
        notes.append("activation offload: not counted without an example batch")
        return activations, peak, 0
    if not m.offloaded_units:
        notes.append(
            "activation offload: nothing moves (no unit below the root saves a tensor of 256 KiB or more; --wrap "
            "makes units)"
        )
        return activations, peak, 0
    moved = sum(m.offloaded_units.values())
    stay = sum(sorted(m.offloaded_units.values(), reverse=True)[:2])
    saved = min(max(0, moved - stay), activations)
    notes.append(
        "activation offload: the units' saved activations in host memory, two units' on the device (derived "
        "from the measured step, not measured)"
    )
    return activations - saved, peak - saved, moved


def _row(m: Measured, opts: EstimateOptions) -> RankEstimate:
    shard_opts = opts.shard
    layouts = m.layouts
    largest = max(layouts, key=lambda L: L.numel)
    lag = _lag(layouts, shard_opts, opts.device)
    overhead = int(opts.overhead or 0)
    notes = [m.optimizer_note] if m.optimizer_note else []
    if m.peak is not None:
        gathered = int(m.gathered_max or 0)
        peak = m.peak + lag + overhead
        activations = m.activations
        comm = dict(m.comm)
        groups = m.group_bytes
        known = m.params + m.grads + m.optimizer + m.buffers + gathered + (activations or 0)
        other = max(0, m.peak - known)
    else:
        gathered = _scheduled_gathered(layouts, shard_opts)
        grad_in_flight = max(
            (L.padded_numel * itemsize(L.reduce_dtype) for L in layouts if any(L.trainable)), default=0
        )
        other = grad_in_flight
        activations = None
        comm, groups = _layout_comm(layouts, shard_opts.reshard_root_after_forward)
        peak = m.params + m.grads + m.optimizer + m.buffers + gathered + other + lag + overhead
        notes.append("no example batch: activations not counted, gathered units from the schedule rules")
        if opts.tensor_parallel_size > 1:
            notes.append("no example batch: the tensor-parallel collectives (of activations) are not counted")
    activations, peak, activations_host = _offload_activations(m, opts, activations, peak, notes)
    host = 0
    if shard_opts.offload_optimizer:  # see [Note: optimizer offload]
        host_copies = sum(
            max(L.grad_numel(r) for r in range(L.shard_world))
            * (itemsize(L.param_dtype) + itemsize(L.grad_dtype))
            for L in layouts
        )
        host = m.optimizer + host_copies
        peak -= m.optimizer
        notes.append(
            "cpu_offload='optimizer': optimizer state and host copies of the trainable shards and gradient shards "
            "in host memory (derived, not measured)"
        )
    if shard_opts.offload_params:
        host = m.params + m.grads + m.optimizer
        copies = sorted((L.shard_numel * itemsize(L.compute_dtype) for L in layouts), reverse=True)[:2]
        peak = peak - m.params - m.optimizer + sum(copies)
        notes.append(
            "CPU offload: shards, gradient shards and optimizer state in host memory (derived, not measured)"
        )
    host += activations_host
    by_group: dict[str, int] = {}  # counted by each group in the measured step, or from the layout
    for role, _, kinds in groups:
        by_group[role] = by_group.get(role, 0) + sum(kinds.values())
    rpn = _ranks_per_node(opts, m)
    cross = _cross_node(groups, opts.micro_batches, rpn)
    tp_comm = next((dict(kinds) for role, _, kinds in groups if role == "tensor_parallel"), {})
    tp_wire = _ring_bytes(tp_comm, opts.tensor_parallel_size)
    row = RankEstimate(
        world_size=m.world,
        shard_group_size=m.shard_group_size,
        units=len({L.path for L in layouts}),
        largest_unit=largest.path,
        largest_unit_numel=largest.numel,
        params=m.params,
        grads=m.grads,
        optimizer=m.optimizer,
        buffers=m.buffers,
        gathered=gathered,
        allocator_lag=lag,
        activations=activations,
        other_transient=other,
        overhead=overhead,
        peak=peak,
        host=host,
        offload=shard_opts.cpu_offload,
        activations_host=activations_host,
        checkpointing=_checkpointing(shard_opts),
        activation_offload=shard_opts.activation_offload,
        device=opts.device,
        measured=m.peak is not None,
        comm=comm,
        comm_by_group={k: v for k, v in by_group.items() if v},
        micro_batches=opts.micro_batches,
        ranks_per_node=rpn,
        cross_node=cross,
        wire=_wire(comm, layouts) + int(tp_wire),
        tensor_parallel_size=opts.tensor_parallel_size,
        tensor_parallel_comm=tp_comm,
        optimizer_exchange=_exchange(layouts, opts.optimizer),
        flops=m.flops,
        capacity=opts.capacity,
        notes=notes,
    )
    _add_timing(row, m, opts)
    return row


def _add_timing(row: RankEstimate, m: Measured, opts: EstimateOptions) -> None:
    if opts.link is None:
        return
    shard_world = max((L.shard_world for L in m.layouts), default=1)
    replicate_world = max((L.replicate_world for L in m.layouts), default=1)
    replicate_link = opts.replicate_link or opts.link
    if m.peak is not None:
        t = step_time(
            m.collectives, m.flops, opts.tflops, shard_world, replicate_world, opts.link, replicate_link
        )
        row.compute_s, row.communication_s, row.exposed_s, row.step_s = t
        if row.tensor_parallel_comm:  # the next operator needs each one's result: none of it overlaps
            inside = row.tensor_parallel_size <= row.ranks_per_node
            link = LINKS["nvlink"] if inside else opts.link
            tp = sum(
                collective_seconds(kind, n, row.tensor_parallel_size, link)
                for kind, n in row.tensor_parallel_comm.items()
            )
            row.communication_s += tp
            row.exposed_s += tp
            row.step_s += tp
            where = "on NVLink (the group is inside a node)" if inside else "on the shard link"
            row.notes.append(f"tensor parallelism: its collectives timed {where}, all of their time exposed")
        return
    total = sum(
        collective_seconds(
            kind,
            n,
            replicate_world if kind == "all_reduce" else shard_world,
            replicate_link if kind == "all_reduce" else opts.link,
        )
        for kind, n in row.comm.items()
    )
    row.communication_s = total
    row.notes.append(
        "no example batch: communication time is the links' busy time, none of it known to overlap"
    )


def _plan(size: Any, plan: Any, target: Any) -> Any:
    """The tensor-parallel plan to use: resolved when a size above 1 asks for one (see [Note: estimating tensor
    parallelism]); otherwise as given, for the options to judge."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 1:
        return resolve_plan(plan, target)
    return plan


def _channel_segments(layouts: list[UnitLayout]) -> int:
    """Shared-memory segments a CPU rank maps: one per rank of each group of more than one rank (see [Note:
    shared-memory collectives])."""
    shard = max((L.shard_world for L in layouts), default=1)
    replicate = max((L.replicate_world for L in layouts), default=1)
    return (shard if shard > 1 else 0) + (replicate if replicate > 1 else 0)


def _add_runtime(rows: list[RankEstimate], runs: list[Measured], target: Any, name: str) -> None:
    """Device "cpu": add the rank's runtime, measured, to each row (see [Note: a rank's runtime])."""
    if not os.path.exists("/proc/self/status"):
        for row in rows:
            row.notes.append(
                "runtime not measured: it reads /proc (Linux); give it with --overhead SIZE (overhead=...)"
            )
        return
    path = factory_path(target)
    logs = [
        Replay([int(s.numel()) * itemsize(L.param_dtype) for L in m.layouts for s in L.shapes], m.allocations)
        for m in runs
        if m.allocations
    ]
    processes = 2 if any(r.world_size > 1 for r in rows) else 1
    try:
        measured = measure_runtime(path, processes, logs)
    except RuntimeError as err:
        raise EstimateError(
            f"measuring a CPU rank's runtime failed: {err} HINT: fix the error above, or give the runtime yourself "
            "with --overhead SIZE (overhead=...), which skips the measurement."
        ) from err
    log = 0
    for row, m in zip(rows, runs, strict=True):
        row.runtime_parts = measured.parts(_channel_segments(m.layouts), log if m.allocations else None)
        log += bool(m.allocations)
        row.runtime = sum(row.runtime_parts.values())
        row.peak += row.runtime
        row.notes += measured.notes
        if not m.allocations:
            row.notes.append("runtime: the allocator's part needs an example batch (a step to replay)")
    if path is None:
        for row in rows:
            row.notes.append(
                f"runtime: the model's imports are not measured: {name} cannot be imported by name in a fresh "
                "process (define the factory at module level in an importable module)"
            )


def estimate(
    target: str | Callable[[], Any],
    world_size: int | str | Sequence[int],
    *,
    sharding_strategy: Any = "FULL_SHARD",
    auto_wrap_policy: Any = None,
    mixed_precision: Any = None,
    cpu_offload: bool | str = False,
    activation_offload: bool = False,
    activation_checkpointing_policy: Any = None,
    activation_checkpointing_mode: Any = "full",
    limit_all_gathers: bool = True,
    backward_prefetch: Any = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    reshard_root_after_forward: bool = False,
    reshard_after_forward: bool | int | None = None,
    shard_group_size: int | Sequence[int] | None = None,
    micro_batches: int = 1,
    ranks_per_node: int | None = None,
    optimizer: str | type = "adamw",
    device: str = "cuda",
    bandwidth: str | float | None = None,
    latency: str | float | None = None,
    replicate_bandwidth: str | float | None = None,
    replicate_latency: str | float | None = None,
    tflops: float = 400.0,
    capacity: int | str | None = None,
    overhead: int | str | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: str | Callable[[Any, Any], Any] | None = None,
) -> Estimate:
    """Estimate per-rank memory and per-step communication of sharded training, without running it.

    Args:
        target: ``"module.path:factory"`` or the factory itself: a callable returning a module, or
            ``(module, example_batch)``; it is called under ``torch.device("meta")``.
        world_size: ranks to estimate for: an int, ``"8,64,512"`` or a list.
        sharding_strategy: as for :class:`flatshard.ShardOptions` (the strategy's own options), and so are
            ``auto_wrap_policy``, ``mixed_precision``, ``cpu_offload``, ``activation_offload`` (the units'
            activations in host memory, two units' on the device; derived from the step's saved tensors),
            ``activation_checkpointing_policy``,
            ``activation_checkpointing_mode`` (run as in training: selective checkpointing keeps what it keeps),
            ``limit_all_gathers``, ``backward_prefetch``, ``forward_prefetch``, ``reshard_root_after_forward`` and
            ``reshard_after_forward`` (an int: the node-local copy's gathers are counted in the ``"node"`` group).
        shard_group_size: hybrid strategies: ranks per shard group (an int or several). Default: 8 (or the
            world size, when smaller).
        micro_batches: micro-batches per optimizer step (gradient accumulation), for the bytes between nodes
            per step (see [Note: bytes between nodes]). Default: 1.
        ranks_per_node: ranks per node, for the bytes between nodes. Default: a hybrid shard group, else 8 (or
            the world size, when smaller).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, ``"muon"``, ``"none"`` or an
            optimizer class (or its import path). Default: ``"adamw"``.
        device: ``"cuda"`` (default) or ``"cpu"``: see [Note: estimating a step].
        bandwidth, latency: the shard group's link: a preset (``"nvlink"``, ``"infiniband"``, ``"ethernet"``)
            or a bandwidth like ``"400GB/s"``, and a latency like ``"5us"``. Without it no times are given.
        replicate_bandwidth, replicate_latency: the replicate group's link (hybrid, NO_SHARD). Default: the
            shard group's.
        tflops: achieved compute per rank in TFLOP/s, for the exposed communication time. Default: 400.
        capacity: memory per device (``"80GiB"``), what "fits" means. Default: 80 GiB on cuda.
        overhead: memory per device outside tensors. Default: 1 GiB on cuda; on cpu the rank's runtime is
            measured instead (see [Note: a rank's runtime]), and a value given replaces the measurement.
        tensor_parallel_size: ranks per tensor-parallel group, ``k``: the ``N`` ranks are a ``(N/k, k)`` mesh
            ("data_parallel", "tensor_parallel"), the model is parallelized over the second dimension and sharded
            over the first; the bytes DTensor sends between the ``k`` ranks are counted in ``comm_by_group``'s
            ``"tensor_parallel"`` (see [Note: estimating tensor parallelism]). Default: 1.
        tensor_parallel_plan: the function ``(model, tp_mesh) -> model`` (or ``"module.path:function"``) that
            parallelizes the model with torch's ``parallelize_module``. Default: the target module's
            ``tensor_parallel_plan`` (``flatshard.testing.llama`` has one).

    Returns:
        An :class:`Estimate`; ``str(format_table(estimate))`` is the command's table.
    """
    shard_options = ShardOptions(
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        activation_offload=activation_offload,
        activation_checkpointing_policy=activation_checkpointing_policy,
        activation_checkpointing_mode=activation_checkpointing_mode,
        limit_all_gathers=limit_all_gathers,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        reshard_root_after_forward=reshard_root_after_forward,
        reshard_after_forward=reshard_after_forward,
    )
    errors = OptionErrors("estimate")
    link: Link | None = errors.check(parse_link, bandwidth, latency, "shard link")
    replicate: Link | None = errors.check(
        parse_link, replicate_bandwidth, replicate_latency, "replicate link"
    )
    cap = errors.check(parse_bytes, capacity, "capacity") if capacity is not None else None
    extra = errors.check(parse_bytes, overhead, "overhead") if overhead is not None else None
    errors.raise_if_any()
    opts = EstimateOptions(
        world_sizes=world_size,  # type: ignore[arg-type]
        shard=shard_options,
        shard_group_sizes=shard_group_size,  # type: ignore[arg-type]
        optimizer=optimizer,
        device=device,
        link=link,
        replicate_link=replicate,
        tflops=tflops,
        capacity=cap,
        overhead=extra,
        micro_batches=micro_batches,
        ranks_per_node=ranks_per_node,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_plan=_plan(tensor_parallel_size, tensor_parallel_plan, target),
    )
    factory = resolve_factory(target)
    name = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))
    rows = []
    runs = []
    measure = opts.device == "cpu" and opts.overhead is None
    for world in opts.world_sizes:
        for group in opts.group_sizes_for(world):
            runs.append(dry_run(factory, name, opts, world, group, log_allocations=measure))
            rows.append(_row(runs[-1], opts))
    if measure and rows:
        _add_runtime(rows, runs, target, name)
    described = {
        "sharding_strategy": shard_options.sharding_strategy.name,
        "auto_wrap_policy": repr(shard_options.auto_wrap_policy),
        "mixed_precision": _describe_precision(shard_options),
        "cpu_offload": shard_options.cpu_offload,
        "activation_offload": shard_options.activation_offload,
        "activation_checkpointing_policy": repr(shard_options.activation_checkpointing_policy),
        "activation_checkpointing_mode": shard_options.activation_checkpointing_mode,
        "limit_all_gathers": shard_options.limit_all_gathers,
        "optimizer": opts.optimizer if isinstance(opts.optimizer, str) else opts.optimizer.__name__,
        "device": opts.device,
        "link": link._asdict() if link else None,
        "replicate_link": (opts.replicate_link._asdict() if opts.replicate_link else None),
        "tflops": opts.tflops,
        "reshard_after_forward": shard_options.reshard_after_forward,
        "micro_batches": opts.micro_batches,
        "ranks_per_node": opts.ranks_per_node,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "tensor_parallel_plan": (
            getattr(opts.tensor_parallel_plan, "__qualname__", repr(opts.tensor_parallel_plan))
            if opts.tensor_parallel_plan is not None
            else None
        ),
    }
    if not rows:
        raise EstimateError("nothing to estimate. HINT: pass --world-size.")
    return Estimate(name, described, rows)
