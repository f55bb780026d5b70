"""Collectives as plain functions over flat 1-D tensors, with backend quirks handled in one place.

Each function issues the collective and returns a :class:`Pending` (the output and the work handle, or
``None`` when the collective finished synchronously). Callers wait on it when they need the output;
that is what lets communication overlap compute, on CUDA streams and on CPU/gloo alike.

Quirks handled here:
- gloo has no AVG reduction: reductions are SUM and the caller divides (``divide_factor``).
- older torch builds lack gloo ``reduce_scatter_tensor``: fall back to all-reduce + local slice, with
  one warning per process group (the fallback moves twice the bytes); only an error that says the operation is not
  supported or implemented selects it, any other error is raised.
- newer torch builds rename ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``.
- CPU tensors of ranks on one host go through shared memory instead of the backend (see
  [Note: shared-memory collectives] in :mod:`flatshard.engine.transport.shm`).
- backends move and sum only some dtypes: see [Note: dtypes on the wire].

[Note: dtypes on the wire]
gloo refuses float8, uint16-64, int16, complex32, the bits dtypes and the float4 pairs ("Invalid scalar type"),
NCCL a different set, and the shared-memory transport knows a fixed list. :data:`NATIVE_DTYPES` are the dtypes
every one of them moves and sums as they are. A collective that only moves data (all-gather, broadcast,
gather) moves a tensor of any other dtype as its bytes: :func:`as_wire` is a ``uint8`` view of them, so the
received bytes land in the caller's tensor bit for bit. A reduction has no byte form: :func:`reduce_scatter_flat`
and :func:`all_reduce_flat` refuse such a dtype with a ``TypeError``, and :func:`check_trainable_dtype` refuses
a trainable parameter whose gradients would need one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from flatshard.engine.transport import groups, memory, shm, watchdog
from flatshard.engine.transport.pieces import FlatPieces

__all__ = [
    "NATIVE_DTYPES",
    "CollectiveTiming",
    "CommStats",
    "InFlight",
    "Pending",
    "all_gather_flat",
    "all_reduce_flat",
    "all_reduce_max",
    "as_wire",
    "check_trainable_dtype",
    "comm_stats",
    "global_rank",
    "group_traffic",
    "reduce_scatter_flat",
    "timeline",
]

log = logging.getLogger("flatshard")

ProcessGroup = Any  # torch.distributed.ProcessGroup; typed loosely for older torch stubs

_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

NATIVE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,  # moved and summed as pairs of floats (torch.view_as_real) by torch.distributed
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
"""Dtypes that every backend (gloo, NCCL, the shared-memory transport) moves and sums as they are; others move
as bytes and are never reduced (see [Note: dtypes on the wire])."""


def as_wire(t: torch.Tensor) -> torch.Tensor:
    """What a collective that only moves data sends or receives for ``t`` (see [Note: dtypes on the wire]).

    ``t`` itself for a dtype in :data:`NATIVE_DTYPES`; otherwise a 1-D ``uint8`` view of its bytes (a view:
    bytes received into it land in ``t``). Raises ``ValueError`` for a tensor that is not contiguous and
    ``TypeError`` for a quantized or non-strided one.
    """
    if t.dtype in NATIVE_DTYPES:
        return t
    if t.is_quantized or t.layout != torch.strided:
        raise TypeError(
            f"A collective cannot move a {'quantized' if t.is_quantized else str(t.layout)} tensor of dtype "
            f"{t.dtype} as bytes. HINT: keep such values out of sharded parameters and buffers."
        )
    if not t.is_contiguous():
        raise ValueError(
            f"A collective moves a {t.dtype} tensor as its bytes, which needs a contiguous tensor; this one has "
            f"shape {tuple(t.shape)} and strides {t.stride()}. HINT: pass t.contiguous() and copy it back."
        )
    return t.reshape(-1).view(torch.uint8)


# what gradients can be: summed by every backend, and floating point or complex
_GRADIENT_DTYPES = frozenset(d for d in NATIVE_DTYPES if d.is_floating_point or d.is_complex)


def _refuse_reduce(kind: str, dtype: torch.dtype) -> None:
    if dtype not in NATIVE_DTYPES:
        raise TypeError(
            f"{kind}: cannot sum {dtype} tensors across ranks; the backends sum only "
            f"{_names(NATIVE_DTYPES)} (see [Note: dtypes on the wire]). HINT: reduce a copy in float32 (or "
            "another of those dtypes) and cast the result back; a parameter of this dtype must not require grad."
        )


def _names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def check_trainable_dtype(name: str, param: torch.Tensor) -> None:
    """Raise ``TypeError`` if ``param`` (named ``name``) requires grad but its gradients cannot be reduced
    across ranks: a dtype outside :data:`NATIVE_DTYPES` or not floating point / complex."""
    dtype = param.dtype
    if not param.requires_grad or dtype in _GRADIENT_DTYPES:
        return
    raise TypeError(
        f"Parameter {name!r} requires grad but has dtype {dtype}: its gradients cannot be reduced across ranks "
        f"(they are summed in {_names(_GRADIENT_DTYPES)}). HINT: freeze it (param.requires_grad_(False)), or "
        "train a float32 or bfloat16 copy and cast it to this dtype in forward (as float8 recipes keep a "
        "high-precision weight)."
    )


class CommStats(Counter[str]):
    """Bytes this process sent into each collective kind (``"all_gather"``, ``"reduce_scatter"``,
    ``"all_reduce"``), and the :func:`timeline` being recorded (``recording``; ``None``: none)."""

    def __init__(self, *args: Any, **kwargs: int) -> None:
        super().__init__(*args, **kwargs)
        self.recording: list[CollectiveTiming] | None = None


def global_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def backend_name(group: ProcessGroup | None) -> str:
    """``group``'s backend as torch names it (``""`` without a process group): ``"gloo"``, ``"nccl"``, one per
    device type (``"cpu:gloo,cuda:nccl"``) or, left for torch to choose, ``"undefined"``."""
    return str(dist.get_backend(group)) if dist.is_available() and dist.is_initialized() else ""


def uses_nccl(group: ProcessGroup | None) -> bool:
    """Whether ``group`` moves CUDA tensors with NCCL, alone or beside another backend."""
    return "nccl" in backend_name(group)


@dataclasses.dataclass
class CollectiveTiming:
    """When one collective was issued, worked on and waited for (``time.perf_counter_ns`` values).

    ``busy`` is when the shared-memory transport's worker ran it (``None`` for a backend's collective,
    whose threads or kernels are not observable here); ``waited`` holds the intervals the issuing
    thread spent blocked in :meth:`Pending.wait`: the communication that was *not* hidden behind
    compute. See :func:`timeline`.
    """

    kind: str
    nbytes: int
    issued_ns: int
    busy: tuple[int, int] | None = None
    waited: list[tuple[int, int]] = dataclasses.field(default_factory=list)


# The process's communication record: public (``flatshard.comm_stats``), so it is one object for the process,
# whatever roots and groups come and go; it holds byte counts and timings only, never tensors or groups.
comm_stats = CommStats()
"""Bytes this process sent into each collective kind (``"all_gather"``, ``"reduce_scatter"``,
``"all_reduce"``); reset with ``comm_stats.clear()``."""


@contextlib.contextmanager
def timeline() -> Iterator[list[CollectiveTiming]]:
    """Record a :class:`CollectiveTiming` for every collective issued inside the block, in issue order.

    What ``python -m benchmarks train --timeline`` uses to show how much communication overlaps compute on
    CPU. Off (and free) outside the block.
    """
    records: list[CollectiveTiming] = []
    previous, comm_stats.recording = comm_stats.recording, records
    try:
        yield records
    finally:
        comm_stats.recording = previous


class Pending(NamedTuple):
    """A collective in flight: ``output`` is valid after ``wait()``."""

    output: torch.Tensor
    work: Any | None  # torch.distributed.Work, or None when already complete
    timing: CollectiveTiming | None = None  # inside comm.timeline()
    label: watchdog.Label | None = None  # what a desync report says of it

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.output
        if self.timing is None:
            _wait(self.work, self.label, self.output)
            return self.output
        start = time.perf_counter_ns()
        _wait(self.work, self.label, self.output)
        self.timing.waited.append((start, time.perf_counter_ns()))
        ended = getattr(self.work, "ended_ns", None)  # a ShmWork: when its worker ran it
        if self.timing.busy is None and ended:
            self.timing.busy = (self.work.started_ns, ended)
        return self.output


class InFlight(NamedTuple):
    """A collective issued for a unit: its work, the side-stream event (CUDA) and what it reads (see [Note:
    stream overlap])."""

    pending: Pending
    event: Any | None  # recorded on the side stream after the collective; None on CPU
    # inputs the side stream reads (one, or a tuple), alive until the compute stream has waited for ``event``
    keepalive: torch.Tensor | FlatPieces | tuple[torch.Tensor, ...] | None
    # CPU offload on CUDA: the host buffer the reduced gradient shard is being copied into, readable once
    # the CPU has waited for the post-backward stream (see [Note: CPU offload])
    host: torch.Tensor | None = None


def _wait(work: Any, label: watchdog.Label | None, output: torch.Tensor) -> None:
    """Wait for a backend's work; a gloo wait on the CPU is sliced so a desync is reported, not a hang.

    See [Note: finding a desync]. A shared-memory work is waited on in slices too (its worker also stops
    on a verdict); a CUDA work's ``wait`` only orders streams and never blocks the CPU.
    """
    limit = watchdog.limit() if label is None else watchdog.group_limit(label.state)
    if output.device.type != "cpu" or limit is None:
        work.wait()
        return
    if label is not None and label.kind == "reduce_scatter":
        watchdog.wait_whole(work, label)  # gloo's reduce_scatter runs inside wait() and ignores a timeout
        return
    watchdog.wait_sliced(work, label)


def _label(
    kind: str, tensor: torch.Tensor, numel: int, group: ProcessGroup | None, where: Any
) -> watchdog.Label:
    state = groups.state_of(group)  # numbered per group: see [Note: state per process group]
    state.flat_seq += 1
    dtype = str(tensor.dtype).removeprefix("torch.")
    return watchdog.Label(kind, numel, dtype, state.ranks, state.flat_seq, where, state.name, state=state)


def _issued(
    kind: str,
    nbytes: int,
    output: torch.Tensor,
    work: Any,
    async_op: bool,
    label: watchdog.Label | None = None,
    c10d_group: ProcessGroup | None = None,
) -> Pending:
    """Count the bytes; time the collective inside :func:`timeline`; wait now unless ``async_op``.
    ``c10d_group``: the group a torch.distributed collective was issued on (its number goes in the label)."""
    if label is not None:
        if work is not None and not isinstance(work, shm.ShmWork):
            pg = c10d_group if c10d_group is not None else dist.group.WORLD
            label = label._replace(c10d_seq=watchdog.c10d_seq(pg))
        watchdog.note_issued(label)  # see [Note: finding a desync]
        if label.state is not None:
            label.state.sent[kind] += nbytes
    comm_stats[kind] += nbytes
    timing = None
    recording = comm_stats.recording
    if recording is not None:
        issued = work.issued_ns if isinstance(work, shm.ShmWork) else time.perf_counter_ns()
        timing = CollectiveTiming(kind, nbytes, issued)
        recording.append(timing)
    pending = Pending(output, work, timing, label)
    if not async_op and work is not None:
        pending.wait()
        return Pending(output, None, timing, label)
    return pending


def _group_size(group: ProcessGroup | None) -> int:
    return int(dist.get_world_size(group))


def _shm_for(group: ProcessGroup | None, *tensors: torch.Tensor) -> shm.ShmGroup | None:
    """The group's shared-memory transport if these tensors can use it (CPU, contiguous, known dtype)."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in shm.DTYPES:
            return None
    return shm.shm_group(group)


def connect(group: ProcessGroup | None) -> None:
    """Collective over ``group`` (``None``: the default group): set up how its flat collectives run (the
    shared-memory channel, or the backend), as its first flat collective would."""
    shm.shm_group(group)


def reads_pieces(group: ProcessGroup | None) -> bool:
    """Whether :func:`reduce_scatter_flat` reads a :class:`FlatPieces` input in place on ``group``.

    True on the shared-memory transport; elsewhere the pieces would be packed into one buffer first.
    Collective the first time a group is used, like any flat collective (see ``shm.shm_group``).
    """
    return shm.shm_group(group) is not None


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool = True,
    where: tuple[str, str, int] | None = None,
) -> Pending:
    """Gather every rank's ``shard`` into ``output`` (``len(output) == world * len(shard)``).

    ``where`` (unit path, phase, training step) names the collective in a desync report (see [Note:
    finding a desync]); the same holds for the other collectives.
    """
    if output.numel() != shard.numel() * _group_size(group):
        raise ValueError(
            f"all_gather_flat: output has {output.numel()} elements, expected "
            f"{shard.numel()} x {_group_size(group)}."
        )
    if output.dtype != shard.dtype:
        raise ValueError(f"all_gather_flat: output is {output.dtype}, the shard {shard.dtype}.")
    nbytes = shard.numel() * shard.element_size()
    label = _label("all_gather", shard, shard.numel(), group, where)
    wire_out, wire_shard = as_wire(output), as_wire(shard)  # see [Note: dtypes on the wire]
    channel = _shm_for(group, wire_out, wire_shard)
    if channel is not None:
        work = channel.all_gather(wire_out, wire_shard, label=label)
    else:
        work = _all_gather_base(wire_out, wire_shard, group=group, async_op=True)
        return _issued("all_gather", nbytes, output, work, async_op, label, group)
    return _issued("all_gather", nbytes, output, work, async_op, label)


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor | FlatPieces,
    group: ProcessGroup | None,
    async_op: bool = True,
    where: tuple[str, str, int] | None = None,
) -> Pending:
    """Sum ``full`` over ranks and keep this rank's slice in ``output``.

    ``full`` may be overwritten (used as scratch by the fallback path). Given as :class:`FlatPieces`, the
    shared-memory transport reads the pieces directly; the other transports get it packed first.
    """
    world = _group_size(group)
    if full.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_flat: input has {full.numel()} elements, expected {output.numel()} x {world}."
        )
    _refuse_reduce("reduce_scatter_flat", full.dtype)
    nbytes = full.numel() * full.element_size()
    label = _label("reduce_scatter", output, full.numel(), group, where)
    if isinstance(full, FlatPieces):
        channel = _shm_for(group, output) if full.device.type == "cpu" else None
        if channel is not None:
            work = channel.reduce_scatter(output, full, label=label)
            return _issued("reduce_scatter", nbytes, output, work, async_op, label)
        full = full.materialize(memory.empty_flat(full.numel(), full.dtype, full.device))
    channel = _shm_for(group, output, full)
    if channel is not None:
        work = channel.reduce_scatter(output, full, label=label)
        return _issued("reduce_scatter", nbytes, output, work, async_op, label)
    state = groups.state_of(group)
    if state.native_reduce_scatter:
        try:
            work = _reduce_scatter_base(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
            return _issued("reduce_scatter", nbytes, output, work, async_op, label, group)
        except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - depends on torch build
            if not _unsupported(err):
                raise
            state.native_reduce_scatter = False
            log.warning(
                "flatshard: the %r backend has no reduce_scatter (%s); gradients are reduced with all_reduce "
                "and sliced from now on on this process group, which moves twice the bytes (%d per reduction of "
                "this size). HINT: use a torch build whose backend implements reduce_scatter_tensor, or NCCL.",
                str(dist.get_backend(group)),
                str(err).splitlines()[0][:200],
                2 * nbytes,
            )
    # Fallback: all-reduce in place, then copy our slice (twice the traffic, same result).
    work = dist.all_reduce(full, group=group, async_op=True)
    label = label._replace(op="all_reduce")  # what it is among the process group's collectives
    pending = _issued("reduce_scatter", nbytes, full, work, False, label, group)
    rank = dist.get_rank(group)
    output.copy_(pending.output[rank * output.numel() : (rank + 1) * output.numel()])
    return Pending(output, None, pending.timing, label)


def _unsupported(err: BaseException) -> bool:
    """Whether a backend refused a collective because it does not implement it (not any other failure)."""
    text = str(err).lower()
    return any(
        phrase in text
        for phrase in ("not supported", "does not support", "unsupported", "not implemented", "no support")
    )


def all_reduce_flat(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool = True,
    where: tuple[str, str, int] | None = None,
) -> Pending:
    """Sum ``tensor`` over ``group`` in place."""
    _refuse_reduce("all_reduce_flat", tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    label = _label("all_reduce", tensor, tensor.numel(), group, where)
    channel = _shm_for(group, tensor)
    if channel is not None:
        work = channel.all_reduce(tensor, label=label)
    else:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _issued("all_reduce", nbytes, tensor, work, async_op, label, group)
    return _issued("all_reduce", nbytes, tensor, work, async_op, label)


def all_reduce_max(
    tensor: torch.Tensor, group: ProcessGroup | None, where: tuple[str, str, int] | None = None
) -> None:
    """The elementwise maximum of ``tensor`` over ``group``, in place, waited for (small tensors: scales)."""
    nbytes = tensor.numel() * tensor.element_size()
    label = _label("all_reduce", tensor, tensor.numel(), group, where)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _issued("all_reduce", nbytes, tensor, work, False, label, group)


def group_traffic(group: ProcessGroup | None) -> tuple[tuple[int, ...], Counter[str]]:
    """``group``'s global ranks, and the bytes this rank sent into its flat collectives so far, per kind (the
    group's own count: see [Note: state per process group])."""
    state = groups.state_of(group)
    return state.ranks, state.sent
