"""A recording stand-in for the CUDA stream API, so the stream protocol is checked on CPU.

[Note: checking streams on CPU]
On CPU ``CommContext.is_cuda`` is False and every stream is the current thread, so ordinary CPU runs never
exercise which stream runs what (see [Note: stream overlap] in ``flatshard.engine.transport.streams``).
Inside :func:`record_streams` the roots of a sharded model get a :class:`FakeCommContext` instead: its
``is_cuda`` is True, so the engine takes its CUDA paths, on CPU tensors, and its streams and events are
plain objects that report to a :class:`StreamRecorder`. A dispatch mode sees every tensor operation, and
the recorder attributes each to the stream current when it was issued, or to the host for an operation on
host memory; it also sees the collectives (``flatshard.engine.transport.comm``), the allocations and frees
of gathered storage (``flatshard.engine.transport.memory``), and every event recorded, waited for and
synchronized.

Ordering is tracked with vector clocks, as a race detector does: each stream, and the host, counts its
operations; an event carries its stream's clock when recorded; a wait merges the event's clock into the
waiting stream's (a synchronize into the host's); an operation is issued by the host, so it comes after
everything the host has seen. Then, for every access to a buffer (a storage):

- a read comes after the last write: the compute stream reads a gathered parameter only after waiting for
  an event recorded after the all-gather, the host reads a pinned buffer only after synchronizing with the
  copy into it;
- a write comes after the last write and after every read since;
- a free (``memory.free_storage``, or the last reference dropped) comes after each use by a stream other
  than the allocating one has been waited for, by the allocating stream or by the host, unless
  ``record_stream`` named that stream: the caching allocator's rule for reusing a block.

A violation is recorded with both operations and where the engine issued them (file, line, function). A
copy between host and device memory that is not ``non_blocking`` from or to pinned memory blocks the host
(its clock merges the stream's) and is listed in :attr:`StreamRecorder.blocking`. Everything still runs
synchronously on CPU, so results are those of an ordinary CPU run: what is checked is the order CUDA needs.

With ``nccl_like=True`` the fake also models NCCL's asynchrony, for the desync detector (see [Note: finding a
desync]): waiting for a collective never blocks the host (NCCL's ``wait`` is a stream dependency), and an
event completes only when every collective issued before it was recorded has completed (``query``), so the
host blocks where it would on a GPU, in the rate limiter. Frees keep the memory (a gloo work may still
write into it), and a gathered buffer may be read before its collective lands: results are not those of a
CPU run there, only the order of host waits is.

What the fake does not see: 0-dim tensors (scalars, the gradient anchor, the loss) are not tracked; host
memory is what :meth:`FakeCommContext.host_empty` returns, the offloaded shards, and what operations on
host memory produce; reading a value back (``item``) is not counted as a synchronization, which only makes
the check stricter. The shared-memory transport's piece-wise reduction is turned off (CUDA never uses it).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import flatshard
from flatshard.engine import runtime
from flatshard.engine.transport import comm, memory
from flatshard.engine.transport.streams import CommContext

__all__ = [
    "HOST",
    "FakeCommContext",
    "FakeEvent",
    "FakeStream",
    "LogEntry",
    "StreamRecorder",
    "record_streams",
]

HOST = "host"
STREAMS = ("compute", "unshard", "pre_unshard", "post_backward", "offload", "reload")

Clock = dict[str, int]


def _merge(into: Clock, other: Clock) -> None:
    for name, value in other.items():
        if into.get(name, 0) < value:
            into[name] = value


class FakeStream:
    """A named stream: ``wait_event`` / ``wait_stream`` / ``synchronize`` as ``torch.cuda.Stream`` has them."""

    def __init__(self, name: str, recorder: StreamRecorder) -> None:
        self.name = name
        self.recorder = recorder

    def wait_event(self, event: FakeEvent) -> None:
        self.recorder.wait(event, self.name)

    def wait_stream(self, other: FakeStream) -> None:
        self.recorder.wait(self.recorder.record(other.name), self.name)

    def synchronize(self) -> None:
        self.recorder.synchronize(self.recorder.record(self.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """An event: the clock of ``stream`` when it was recorded."""

    def __init__(self, recorder: StreamRecorder, stream: str, clock: Clock) -> None:
        self.recorder = recorder
        self.stream = stream
        self.clock = clock

    works: tuple[Any, ...] = ()  # with nccl_like: the collectives issued before it was recorded

    def synchronize(self) -> None:
        for work in self.works:
            work.wait()
        self.recorder.synchronize(self)

    def query(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self, stream: FakeStream | None = None) -> None:
        self.recorder.wait(self, stream.name if stream is not None else "compute")

    def __repr__(self) -> str:
        return f"FakeEvent({self.stream}@{self.clock.get(self.stream, 0)})"


class LogEntry(NamedTuple):
    """One recorded step: what ran (a collective, a copy, an event, an allocation or free), where."""

    stream: str  # the stream it ran on ("host" for the CPU)
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "h2d", "d2h", "alloc", "free", "record",
    # "wait", "synchronize", "record_stream"
    detail: str
    where: str  # the engine line that issued it


@dataclass
class _Access:
    stream: str
    clock: int
    op: str
    where: str

    def describe(self) -> str:
        return f"{self.op} on {self.stream} at {self.where}"


@dataclass
class _Buffer:
    number: int
    shape: str
    ref: StorageWeakRef
    host: bool = False
    pinned: bool = False
    alloc: str = "compute"
    write: _Access | None = None
    reads: dict[str, _Access] = field(default_factory=dict)  # latest read per stream since the last write
    users: dict[str, _Access] = field(default_factory=dict)  # latest use per stream since allocated
    recorded: set[str] = field(default_factory=set)  # streams named by record_stream

    def label(self) -> str:
        kind = "pinned host" if self.pinned else "host" if self.host else f"device, allocated on {self.alloc}"
        return f"buffer #{self.number} ({self.shape}, {kind})"


_PACKAGE = os.path.dirname(flatshard.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _where() -> str:
    """The innermost flatshard frame issuing the current operation (else the innermost caller outside torch)."""
    frame = sys._getframe(2)
    fallback = "?"
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            return f"{name.removeprefix(_PACKAGE)}:{frame.f_lineno} ({frame.f_code.co_name})"
        if fallback == "?" and not name.startswith(_TORCH) and name != __file__:
            fallback = f"{os.path.basename(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return fallback


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _tracked(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() > 0 and not t.is_sparse


class StreamRecorder:
    """Streams, events and buffers of one recording, and what went wrong (see [Note: checking streams on CPU]).

    Attributes:
        violations: one message per distinct ordering error (same operations at the same lines count once).
        blocking: host/device copies that block the host, with where they were issued.
        log: collectives, copies between host and device, events, waits, allocations and frees, in order.
        ops: how many operations of each name ran on each stream (``(stream, "aten.mm.default")``).
    """

    def __init__(self) -> None:
        self.clocks: dict[str, Clock] = {name: {} for name in (HOST, *STREAMS)}
        self.violations: list[str] = []
        self.blocking: list[str] = []
        self.log: list[LogEntry] = []
        self.ops: Counter[tuple[str, str]] = Counter()
        self._seen: set[tuple[str, ...]] = set()
        self._buffers: dict[int, _Buffer] = {}  # by storage (its StorageImpl, held weakly: never reused)
        self._count = 0
        self._current: list[str] = ["compute"]
        self._paused = 0
        self.nccl_like = False  # see record_streams
        self.in_flight: list[Any] = []  # with nccl_like: collectives not waited for by the host
        self._streams = {name: FakeStream(name, self) for name in STREAMS}

    # ------------------------------------------------------------------ streams and events
    def stream(self, name: str) -> FakeStream:
        return self._streams[name]

    @property
    def current(self) -> str:
        return self._current[-1]

    @contextmanager
    def on(self, name: str) -> Iterator[None]:
        self._current.append(name)
        try:
            yield
        finally:
            self._current.pop()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Operations inside run unrecorded (the insides of a collective recorded as one operation)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def record(self, stream: str) -> FakeEvent:
        _merge(self.clocks[stream], self.clocks[HOST])
        event = FakeEvent(self, stream, dict(self.clocks[stream]))
        if self.nccl_like:
            self.in_flight = [work for work in self.in_flight if not work.is_completed()]
            event.works = tuple(self.in_flight)
        self._log(stream, "record", repr(event))
        return event

    def wait(self, event: FakeEvent, stream: str) -> None:
        self.collect()  # frees before this point are checked against the clocks before it
        _merge(self.clocks[stream], self.clocks[HOST])
        _merge(self.clocks[stream], event.clock)
        self._log(stream, "wait", repr(event))

    def synchronize(self, event: FakeEvent) -> None:
        self.collect()
        _merge(self.clocks[HOST], event.clock)
        self._log(HOST, "synchronize", repr(event))

    def _issue(self, stream: str) -> int:
        """An operation on ``stream``, issued by the host now: its clock value."""
        clock = self.clocks[stream]
        if stream != HOST:
            _merge(clock, self.clocks[HOST])
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def _before(self, access: _Access, stream: str) -> bool:
        """Whether ``access`` is known to be complete for work issued on ``stream`` now."""
        return access.stream == stream or self.clocks[stream].get(access.stream, 0) >= access.clock

    def _log(self, stream: str, kind: str, detail: str) -> None:
        self.log.append(LogEntry(stream, kind, detail, _where()))

    # ------------------------------------------------------------------ buffers
    def _buffer(self, t: torch.Tensor, fresh_on: str | None = None) -> _Buffer | None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = storage._cdata
        buf = self._buffers.get(key)
        if buf is None:
            self._count += 1
            dtype = str(t.dtype).removeprefix("torch.")
            buf = _Buffer(self._count, f"{storage.nbytes()} bytes, {dtype}", StorageWeakRef(storage))
            if fresh_on is not None:
                buf.alloc = fresh_on
            self._buffers[key] = buf
        return buf

    def register_host(self, t: torch.Tensor, pinned: bool = True) -> None:
        """Declare ``t``'s storage host memory (pinned: copies from and to it need not block)."""
        buf = self._buffer(t)
        if buf is not None:
            buf.host, buf.pinned = True, pinned

    def alloc(self, t: torch.Tensor) -> None:
        """``memory.alloc_storage``: ``t``'s storage is a new block of the current stream."""
        buf = self._buffer(t)
        if buf is not None:
            buf.alloc = self.current
            buf.write, buf.reads, buf.users, buf.recorded = None, {}, {}, set()
            self._log(self.current, "alloc", buf.label())

    def free(self, t: torch.Tensor) -> None:
        """``memory.free_storage``: check the free, then forget the block's history."""
        buf = self._buffer(t)
        if buf is None:
            return
        self._check_free(buf, "memory.free_storage")
        self._log(self.current, "free", buf.label())
        buf.write, buf.reads, buf.users, buf.recorded = None, {}, {}, set()

    def record_stream(self, t: torch.Tensor, stream: str) -> None:
        buf = self._buffer(t)
        if buf is not None:
            buf.recorded.add(stream)
            self._log(stream, "record_stream", buf.label())

    def collect(self) -> None:
        """Check the frees of buffers whose last reference was dropped since the last call."""
        dead = [key for key, buf in self._buffers.items() if buf.ref.expired()]
        for key in dead:
            buf = self._buffers.pop(key)
            self._check_free(buf, "its last reference dropped")

    def _check_free(self, buf: _Buffer, how: str) -> None:
        if buf.host:  # the pinned host allocator records the streams that used a block by itself
            return
        for stream, use in buf.users.items():
            if stream in (buf.alloc, HOST) or stream in buf.recorded:
                continue
            if self._before(use, buf.alloc) or self._before(use, HOST):
                continue
            self._violation(
                ("free", use.op, use.where, how),
                f"{buf.label()} freed ({how}) while its use by {use.describe()} was never waited for by "
                f"{buf.alloc} (its allocating stream) or the host, and no record_stream named {stream}",
            )

    # ------------------------------------------------------------------ accesses
    def _access(self, buf: _Buffer, stream: str, clock: int, write: bool, op: str, where: str) -> None:
        access = _Access(stream, clock, op, where)
        last = buf.write
        if last is not None and not self._before(last, stream):
            what = "writes" if write else "reads"
            self._violation(
                ("after-write", last.op, last.where, stream),
                f"{stream} {what} {buf.label()} in {access.describe()}, written by {last.describe()}, "
                f"without waiting for it: no event recorded after that write was waited for by {stream}",
            )
        if write:
            for read in buf.reads.values():
                if not self._before(read, stream):
                    self._violation(
                        ("after-read", read.op, read.where, stream),
                        f"{stream} overwrites {buf.label()} in {access.describe()} while the read by "
                        f"{read.describe()} was not waited for",
                    )
            buf.write, buf.reads = access, {}
        else:
            buf.reads[stream] = access
        buf.users[stream] = access

    def _violation(self, key: tuple[str, ...], message: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(message)

    def operation(
        self,
        op: str,
        reads: list[torch.Tensor],
        writes: list[torch.Tensor],
        fresh: list[torch.Tensor],
        allocates_only: bool = False,
        non_blocking: bool = False,
        is_copy: bool = False,
    ) -> None:
        """One operation: ``reads`` / ``writes`` are its tensor arguments, ``fresh`` the new tensors it made."""
        where = _where()
        inputs = [(t, self._buffer(t)) for t in reads + writes if _tracked(t)]
        on_host = [b.host for _, b in inputs if b is not None]
        stream = self.current
        transfer = ""
        blocks = False
        if is_copy and len(on_host) == 2 and on_host[0] != on_host[1]:  # [src, dst] in different memories
            src_host = on_host[0]
            transfer = "h2d" if src_host else "d2h"
            host_buf = inputs[0][1] if src_host else inputs[1][1]
            assert host_buf is not None
            blocks = not (non_blocking and host_buf.pinned)
            if blocks:
                self.collect()
                self.blocking.append(f"{transfer} copy of {host_buf.label()} at {where}")
        elif any(on_host):
            stream = HOST
        clock = self._issue(stream)
        self.ops[(stream, op)] += 1
        written = {id(t) for t in writes}
        for t, buf in inputs:
            if buf is not None:
                self._access(buf, stream, clock, id(t) in written, op, where)
        for t in fresh:
            if not _tracked(t):
                continue
            buf = self._buffer(t, fresh_on=stream)
            if buf is None:
                continue
            if stream == HOST:
                buf.host = True
            if not allocates_only:
                self._access(buf, stream, clock, True, op, where)
        if transfer:
            self.log.append(LogEntry(stream, transfer, op, where))
        if blocks:  # the host waits for the copy (and so for all work before it on that stream)
            _merge(self.clocks[HOST], self.clocks[stream])

    def collective(self, kind: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        """A collective issued on the current stream: it reads ``reads`` and writes ``writes`` there."""
        self.operation(kind, reads, writes, [])
        self._log(self.current, kind, ", ".join(str(tuple(t.shape)) for t in writes))

    @contextmanager
    def recording(self) -> Iterator[StreamRecorder]:
        """Report every tensor operation inside the block, and ``Tensor.record_stream`` calls, to this recorder."""
        original = torch.Tensor.record_stream

        def record_stream(t: torch.Tensor, stream: Any) -> None:
            self.record_stream(t, stream.name)

        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]
        try:
            with _Mode(self):
                yield self
            self.collect()
        finally:
            torch.Tensor.record_stream = original  # type: ignore[method-assign]

    def kinds_on(self, kind: str) -> set[str]:
        """The streams on which log entries of ``kind`` ran."""
        return {e.stream for e in self.log if e.kind == kind}


class FakeCommContext(CommContext):
    """A ``CommContext`` that says it is on CUDA, with streams and events that report to ``recorder``."""

    def __init__(self, device: torch.device, recorder: StreamRecorder) -> None:
        self.device = device
        self.is_cuda = True
        self.recorder = recorder
        self.compute = recorder.stream("compute")
        self.unshard = recorder.stream("unshard")
        self.pre_unshard = recorder.stream("pre_unshard")
        self.post_backward = recorder.stream("post_backward")
        self.offload = recorder.stream("offload")
        self.reload = recorder.stream("reload")

    def refresh_compute(self) -> None:
        pass

    @contextmanager
    def on(self, stream: Any | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with self.recorder.on(stream.name):
            yield

    def record(self, stream: Any | None = None) -> FakeEvent:
        return self.recorder.record(stream.name if stream is not None else "compute")

    def wait(self, event: Any | None, stream: Any | None = None) -> None:
        if event is not None:
            self.recorder.wait(event, stream.name if stream is not None else "compute")

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self.recorder.paused():
            t = torch.empty(numel, dtype=dtype)
        self.recorder.register_host(t, pinned=True)
        return t


class _Mode(TorchDispatchMode):
    """Reports every tensor operation to the recorder: which arguments it reads and writes, what it made."""

    def __init__(self, recorder: StreamRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recorder._paused:
            return out
        schema = func._schema
        collective = schema.name.startswith("c10d::")
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        non_blocking = False
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.name == "non_blocking":
                non_blocking = bool(value)
            written = collective or (arg.alias_info is not None and arg.alias_info.is_write)
            for t in _tensors(value):
                (writes if written else reads).append(t)
        inputs = {t.untyped_storage()._cdata for t in reads + writes}
        made = list(_tensors(out))
        fresh = [t for t in made if t.untyped_storage()._cdata not in inputs]
        if made and not fresh and not writes and not collective:
            return out  # a view or alias of an input: no data is touched
        name = str(func)
        self.recorder.operation(
            name,
            reads,
            writes,
            fresh,
            allocates_only=name.startswith("aten.empty") or name.startswith("aten.new_empty"),
            non_blocking=non_blocking,
            is_copy=name == "aten.copy_.default",
        )
        return out


def _wrap_collective(
    recorder: StreamRecorder, kind: str, original: Callable[..., comm.Pending], reads_at: int | None
) -> Callable[..., comm.Pending]:
    def collective(*args: Any, **kwargs: Any) -> comm.Pending:
        written = args[0]
        read = args[reads_at] if reads_at is not None else None
        read_tensors = [read] if isinstance(read, torch.Tensor) else list(getattr(read, "_pieces", []))
        recorder.collective(kind, read_tensors, [written])
        with recorder.paused():
            return original(*args, **kwargs)

    return collective


@contextmanager
def record_streams(model: nn.Module, nccl_like: bool = False) -> Iterator[StreamRecorder]:
    """Run the block with ``model``'s roots on a :class:`FakeCommContext`, recording every stream's work.

    Call it around whole training steps of a model sharded on CPU (before its first forward, or between
    steps); on exit the roots get an ordinary ``CommContext`` back. See [Note: checking streams on CPU].
    ``nccl_like``: the host never waits for a collective, events wait for them (for desync tests only).
    """
    from flatshard.engine import unit_states

    recorder = StreamRecorder()
    recorder.nccl_like = nccl_like
    for handle in (h for state in unit_states(model) for h in state.handles):
        if handle.offload:
            recorder.register_host(handle.sharded, pinned=True)
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def fake_context(device: torch.device) -> FakeCommContext:
        return FakeCommContext(device, recorder)

    alloc_storage, free_storage, pending_wait = memory.alloc_storage, memory.free_storage, comm.Pending.wait

    def alloc(t: torch.Tensor, kept: Any = None) -> None:
        was_empty = t.untyped_storage().nbytes() == 0
        with recorder.paused():
            alloc_storage(t, kept)
        if was_empty:
            recorder.alloc(t)

    def free(t: torch.Tensor, kept: Any = None) -> None:
        recorder.free(t)
        if nccl_like:
            return  # a collective may still write into it: keep the memory
        with recorder.paused():
            free_storage(t, kept)

    def wait(self: comm.Pending) -> torch.Tensor:
        if nccl_like and self.work is not None:
            recorder.in_flight.append(self.work)  # a stream waits, not the host
            return self.output
        with recorder.paused():
            return pending_wait(self)

    patch(runtime, "CommContext", fake_context)
    patch(memory, "alloc_storage", alloc)
    patch(memory, "free_storage", free)
    patch(comm.Pending, "wait", wait)
    patch(comm, "reads_pieces", lambda group: False)
    patch(comm, "all_gather_flat", _wrap_collective(recorder, "all_gather", comm.all_gather_flat, 1))
    patch(
        comm, "reduce_scatter_flat", _wrap_collective(recorder, "reduce_scatter", comm.reduce_scatter_flat, 1)
    )
    patch(comm, "all_reduce_flat", _wrap_collective(recorder, "all_reduce", comm.all_reduce_flat, None))
    roots = [s.ctx for s in unit_states(model) if s.ctx is not None and s.ctx.root is s]
    real = [(ctx, ctx.streams) for ctx in roots]
    for ctx in roots:
        ctx.streams = FakeCommContext(ctx.streams.device, recorder)
    try:
        with recorder.recording():
            yield recorder
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        for ctx, streams in real:
            ctx.streams = streams
        for state in unit_states(model):
            made = state.ctx
            if made is not None and isinstance(made.streams, FakeCommContext):
                made.streams = CommContext(made.streams.device)
