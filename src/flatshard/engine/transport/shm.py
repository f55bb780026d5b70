"""Collectives over shared memory for CPU ranks of one host.

[Note: shared-memory collectives]
On CPU, gloo moves a collective's bytes through loopback TCP: the kernel copies them in and out of
socket buffers, gloo's all-gather stages the result in a temporary the size of the output and copies
it again, and all of it runs on CPU cores that the ranks' compute needs. Measured on the 2-core
machine of ``docs/benchmarks.md``, a 48 MiB all-gather over 2 ranks took 59 ms and 44 ms of CPU time,
where copying 48 MiB takes 6 ms. When every rank of a group runs on one host, flatshard's own
transport replaces it for the flat collectives of a training step (all-gather, reduce-scatter,
all-reduce of CPU tensors):

* Each rank owns a small shared-memory segment (a header page and two slots of ``slot_bytes``) that
  every peer maps. A collective runs in *steps* of at most one slot per rank: a rank writes its part
  into its slot ``step % 2``, publishes ``step`` in its header, waits until every peer published it,
  then reads the peers' slots straight into its output (or adds them into its slice). Each byte is
  copied once into shared memory and once out; nothing is allocated.
* A rank rewrites slot ``s`` two steps later, after every peer published the step in between, which
  no peer does before it has read slot ``s``: two slots pipeline without a second wait per step.
* Waiting is a futex on the peer's published counter (shared mappings make it a cross-process
  futex): a sleeping rank costs no CPU and wakes within microseconds of the publish.
* The steps run on one worker thread per group, in the order the collectives were issued (the same
  order on every rank, as for any collective); :class:`ShmWork` is the handle, so the next unit's
  all-gather and the previous unit's reduce-scatter overlap compute just as gloo's async work does.
* Each slot's header records the collective, its size and dtype: ranks that issued different
  collectives get an error naming both, not corrupt data.
* A peer that exited or stopped publishing is reported (rank, pid, collective) instead of a hang:
  waits wake every half second to check that every peer process is alive and whether the ranks are
  known to be out of step (see [Note: finding a desync]), and give up after ``timeout`` seconds.
  The header also carries, per slot, where the collective was issued (unit, phase, step), so a
  mismatch names both sides' positions.

The transport is agreed on once per group by all its ranks (one object collective on first use), so
a rank that cannot create or map a segment makes every rank use gloo, never hang. Segments have no name
(see [Note: segments without names]). Used on Linux x86-64 only (its stores are ordered, so a published
counter implies the slot's bytes are visible); elsewhere, for several hosts, or with ``FLATSHARD_SHM=0``,
collectives go to the process group's backend.

[Note: reading peers directly]
An all-gather through the slots copies each rank's part three times: into the output, into its slot, and from
the slot into each peer's output. Where the kernel lets a rank read its peers' memory (``process_vm_readv``,
checked once per group by every rank reading each peer, and agreed on by all), an all-gather instead publishes
the address of each rank's source with the step, each rank copies its own part and reads every peer's part
from that peer's memory straight into its output, then publishes a second step: a rank's all-gather completes
only when every peer has read its source, so the source may change again afterwards (the contract of any
asynchronous collective: its input is left alone until the work completes). Two copies instead of three, and
two waits per all-gather instead of one per slot; measured on the 2-core VM of ``docs/benchmarks.md``, a 50 MB
all-gather of 2 ranks took 3.3 ms instead of 5.5. Reads from huge pages run near ``memcpy`` speed, so shards
ask for them (4 KiB pages read at half that). Where a security policy forbids it (Yama's ``ptrace_scope`` of
1 or more between sibling processes, a seccomp profile), the slots are used; reduce-scatters and all-reduces
always use them.

[Note: segments without names]
A file in ``/dev/shm`` lives until someone unlinks it, and a process killed by SIGKILL unlinks nothing: a
named segment outlives a rank killed between creating it and the moment every peer has mapped it, and the
whole job is often killed at once (a scheduler, the OOM killer, Ctrl-C twice), leaving nobody to clean up.
So a segment is an anonymous memory file (``memfd_create``): it never appears in ``/dev/shm`` and its memory is
freed when the last process mapping it exits, however it exits. Its owner keeps the file descriptor open
while the peers open it through ``/proc/<owner pid>/fd/<fd>`` (and check that they got the file whose inode
the owner published), then closes it once every peer has mapped the segment (or gave up); the mappings stay
valid. Where that cannot work (no ``memfd_create``, ``/proc`` of the other ranks not visible, as across PID
namespaces) the ranks agree on the backend instead. :func:`remove_stale_segments` still removes the named
segments left in ``/dev/shm`` by flatshard versions that created them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import platform
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatshard.engine.transport import watchdog
from flatshard.engine.transport.env import env_flag
from flatshard.engine.transport.groups import state_of
from flatshard.engine.transport.memory import libc
from flatshard.engine.transport.pieces import FlatPieces
from flatshard.engine.transport.processes import pid_gone

__all__ = [
    "DTYPES",
    "Segment",
    "ShmGroup",
    "ShmWork",
    "anonymous_segments",
    "exchange_segments",
    "host_key",
    "remove_stale_segments",
    "shm_group",
]

ProcessGroup = Any

_SHM_DIR = "/dev/shm"
_HEADER = 4096  # bytes before the slots: the published counter and one record per slot
_SEQ_OFFSET = 0  # int32: the last step this rank published
_SLOT_RECORD = (64, 128)  # int64[4] per slot: collective code, numel, dtype index; the source's address
_SLOT_LABEL = (1024, 2048)  # per slot: where the collective was issued (UTF-8, NUL-terminated)
_LABEL_BYTES = 1024
DEFAULT_SLOT_BYTES = 2 << 20
DEFAULT_TIMEOUT_S = 1800.0

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_POLL_S = 0.5

_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_gather (direct)", "all_gather (direct, read)")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def host_key() -> str:
    """Identifies this host (and boot): ranks with equal keys can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def remove_stale_segments() -> None:
    """Unlink the ``flatshard-<kind>-<pid>-<random>`` names in ``/dev/shm`` of processes of this host that no
    longer run: named segments of earlier flatshard versions (this one names none, see [Note: segments without
    names])."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "flatshard" or not parts[2].isdigit():
            continue
        if pid_gone(int(parts[2])):
            with contextlib.suppress(OSError):  # another process may be removing it too
                os.unlink(os.path.join(_SHM_DIR, name))


class Segment:
    """A shared-memory file mapped into this process: created by its owner, opened by peers.

    ``path=None`` (with ``create``) makes an anonymous segment (see [Note: segments without names]), whose
    :attr:`path` for the peers is ``/proc/<pid>/fd/<fd>`` until :meth:`unpublish`; a path names a file
    (tests use files of a temporary folder). A peer's segment is only mapped: it keeps no descriptor open.
    """

    def __init__(self, path: str | None, nbytes: int, create: bool) -> None:
        self.nbytes = nbytes
        self.reserved = not create  # a peer's segment: its owner reserved it
        named = path is not None
        if path is None:
            if not create:
                raise ValueError("Segment(path=None) needs create=True: a peer opens its owner's path.")
            fd = os.memfd_create("flatshard", os.MFD_CLOEXEC)
            path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        self.path = path
        self._fd: int | None = fd  # the owner's, while peers may still open ``path``
        try:
            info = os.fstat(fd)
            self.identity = (info.st_dev, info.st_ino)  # peers check they opened this very file
            if create:
                os.ftruncate(fd, nbytes)  # sized, but no page is allocated before reserve() or a write
            elif info.st_size != nbytes:
                raise OSError(errno.EINVAL, f"{path} holds {info.st_size} bytes, not the {nbytes} expected")
            self._map: mmap.mmap | None = mmap.mmap(
                fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            self.unpublish()
            if create and named:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        if not create:
            self.unpublish()
        self.bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def reserve(self) -> None:
        """Allocate the segment's pages now (before :meth:`unpublish`): a lack of memory then fails here, with
        an ``OSError``, not with SIGBUS on the first write."""
        if not self.reserved:
            if self._fd is None:
                raise OSError(errno.EBADF, f"segment {self.path} was unpublished before it was reserved")
            os.posix_fallocate(self._fd, 0, self.nbytes)
            self.reserved = True

    def unpublish(self) -> None:
        """Close the descriptor behind :attr:`path`: no other process can open the segment any more; mappings
        stay valid. A named file keeps its name (its creator removes it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def view(self, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` from byte ``start`` of the segment."""
        assert self.bytes is not None
        return self.bytes[start : start + numel * dtype.itemsize].view(dtype)

    def slot(self, index: int, slot_bytes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.view(index * slot_bytes, numel, dtype)

    def int32(self, offset: int) -> ctypes.c_int32:
        assert self._map is not None
        return ctypes.c_int32.from_buffer(self._map, offset)

    def int64s(self, offset: int, n: int) -> Any:
        assert self._map is not None
        return (ctypes.c_int64 * n).from_buffer(self._map, offset)

    def write(self, offset: int, data: bytes) -> None:
        assert self._map is not None
        self._map[offset : offset + len(data)] = data

    def read_cstring(self, offset: int, limit: int) -> str:
        assert self._map is not None
        raw = self._map[offset : offset + limit]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        self.unpublish()
        self.bytes = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the map goes with it
                self._map.close()


@functools.cache
def _futex() -> Callable[..., int] | None:
    c = libc() if platform.machine() in ("x86_64", "AMD64") else None
    if c is None:
        return None
    fn = c.syscall
    # syscall(SYS_futex, uaddr, op, val, timeout, uaddr2, val3)
    fn.argtypes = [
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_long
    return fn  # type: ignore[no-any-return]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class ShmWork:
    """The handle of a collective issued to a :class:`ShmGroup` (``wait()`` like a c10d ``Work``)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        # When it was handed to the worker, and when the worker ran it (time.perf_counter_ns): what comm.timeline
        # reports as the issue time and the transport time (the worker may start before the issuer records it).
        self.issued_ns = time.perf_counter_ns()
        self.started_ns = 0
        self.ended_ns = 0

    def wait(self, timeout: Any = None) -> bool:
        """Like ``Work.wait``: a ``timedelta`` or seconds; past it, ``RuntimeError("... timed out")`` and the
        work stays pending (how a desync is looked for between slices)."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._done.wait(seconds):
            raise RuntimeError("shared-memory collective: wait timed out; the work is still pending")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.ended_ns = time.perf_counter_ns()
        self._done.set()


class ShmGroup:
    """Flat collectives among the ranks of ``group``, all on this host; see [Note: shared-memory
    collectives]. Build it with :func:`shm_group` (collective), not directly."""

    def __init__(
        self,
        rank: int,
        world: int,
        own: Segment,
        peers: dict[int, Segment],
        pids: list[int],
        global_ranks: list[int],
        slot_bytes: int,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.world = world
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self._segments = {rank: own, **peers}
        self._pids = pids
        self._global_ranks = global_ranks
        self._seq = {r: seg.int32(_SEQ_OFFSET) for r, seg in self._segments.items()}
        self._records = {
            r: tuple(seg.int64s(off, 4) for off in _SLOT_RECORD) for r, seg in self._segments.items()
        }
        self.direct = (
            False  # all-gathers read the peers' sources in place: see [Note: reading peers directly]
        )
        self._step = 0
        self._label: watchdog.Label | None = None  # the collective the worker runs
        self._label_bytes = b"\0"
        self._futex = _futex()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flatshard-shm", daemon=True)
        self._thread.start()

    # -- issuing -----------------------------------------------------------------------------------

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, label: watchdog.Label | None = None
    ) -> ShmWork:
        """Every rank's ``shard`` into ``output`` (1-D, ``world * len(shard)`` elements), in rank order.

        ``label`` (any of the collectives) names it in error messages (see [Note: finding a desync])."""
        return self._issue(self._all_gather_direct if self.direct else self._all_gather, label, output, shard)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor | FlatPieces, label: watchdog.Label | None = None
    ) -> ShmWork:
        """The sum over ranks of slice ``rank`` of ``full`` into ``output`` (``len(full) = world * len(output)``).

        ``full`` may be given as :class:`FlatPieces` (a gradient still in autograd's per-parameter tensors):
        each step copies its part straight into the slot, so no packed copy of it is ever made, and the
        pieces are released as soon as the collective is done.
        """
        return self._issue(self._reduce_scatter, label, output, full)

    def all_reduce(self, tensor: torch.Tensor, label: watchdog.Label | None = None) -> ShmWork:
        """The sum over ranks of ``tensor``, in place (every rank adds in rank order: equal results)."""
        return self._issue(self._all_reduce, label, tensor)

    def _issue(
        self, fn: Callable[..., None], label: watchdog.Label | None, *tensors: torch.Tensor | FlatPieces
    ) -> ShmWork:
        work = ShmWork()
        if self._closing:
            raise RuntimeError(
                "flatshard: a collective was issued on a shared-memory channel that was closed with its process "
                "group. HINT: do not use a process group after torch.distributed.destroy_process_group()."
            )
        if self._broken is not None:  # an earlier collective failed: the ranks are out of step
            work._finish(_stopped(self._broken))
            return work
        self._queue.put((fn, label, tensors, work))
        return work

    def close(self) -> None:
        """Stop the worker once the collectives issued so far are done, then unmap the segments (the memory of
        a segment is freed when the last process mapping it unmaps it). Waits up to a second for the worker,
        unless called from it; idempotent."""
        if self._closing:
            return
        self._closing = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # closed: see close()
                self._seq, self._records = {}, {}
                for segment in self._segments.values():
                    segment.close()
                return
            fn, label, tensors, work = item
            del item
            if self._broken is not None:
                work._finish(_stopped(self._broken))
                continue
            work.started_ns = time.perf_counter_ns()
            self._label = label
            self._label_bytes = (label.describe() if label is not None else "").encode()[
                : _LABEL_BYTES - 1
            ] + b"\0"
            try:
                fn(*tensors)
            except BaseException as err:  # reported to the waiter, and to every later collective
                self._broken = err
                work._finish(err)
            else:
                work._finish()
            finally:
                watchdog.unblocked()
                self._label = None
            del fn, tensors, work, label  # no reference outlives the collective

    # -- steps -------------------------------------------------------------------------------------

    def _mine(self, slot: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._at(self.rank, slot, offset, numel, dtype)

    def _at(self, r: int, slot: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._segments[r].view(_HEADER + slot * self.slot_bytes + offset, numel, dtype)

    def _publish_and_wait(self, op: int, numel: int, dtype: torch.dtype, address: int = 0) -> int:
        """Record this step's collective (and ``address``, a source peers may read), publish the step, wait
        for every peer to publish it. Returns the step's slot."""
        slot = self._step % 2
        self._step += 1
        target = self._step & 0xFFFFFFFF
        mine = (op, numel, DTYPES.index(dtype))
        record = self._records[self.rank][slot]
        record[0], record[1], record[2], record[3] = (*mine, address)
        self._segments[self.rank].write(_SLOT_LABEL[slot], self._label_bytes)
        seq = self._seq[self.rank]
        seq.value = target if target < 0x80000000 else target - 0x100000000
        if self._futex is not None:
            self._futex(_SYS_FUTEX, ctypes.addressof(seq), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        for r in range(self.world):
            if r != self.rank:
                self._wait_for(r, target, op, numel, dtype)
                theirs = tuple(self._records[r][slot])[:3]
                if theirs != mine:
                    raise watchdog.DesyncError(self._mismatch(r, slot, theirs, op, numel, dtype))
        return slot

    def _wait_for(self, r: int, target: int, op: int, numel: int, dtype: torch.dtype) -> None:
        word = self._seq[r]
        start = time.monotonic()
        poll = _Timespec(int(_POLL_S), int((_POLL_S % 1) * 1e9))  # a futex wait's timeout
        while True:
            value = word.value & 0xFFFFFFFF
            if (value - target) & 0xFFFFFFFF < 0x80000000:  # value >= target, modulo 2**32
                return
            if self._futex is not None:
                observed = value if value < 0x80000000 else value - 0x100000000
                rc = self._futex(
                    _SYS_FUTEX, ctypes.addressof(word), _FUTEX_WAIT, observed, ctypes.byref(poll), None, 0
                )
                err = ctypes.get_errno() if rc != 0 else 0
                if err not in (0, errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                    raise OSError(err, f"futex wait failed: {os.strerror(err)}")
            else:  # pragma: no cover - the transport is only enabled where futexes are available
                time.sleep(0.0005)
            if (word.value & 0xFFFFFFFF) == value:
                self._check_peer(r, start, op, numel, dtype)

    def _check_peer(self, r: int, start: float, op: int, numel: int, dtype: torch.dtype) -> None:
        what = f"{_OPS[op]} of {numel} {dtype} elements per rank"
        if self._label is not None:
            what = self._label.describe()
        if pid_gone(self._pids[r]):
            watchdog.adopt_verdict()  # a desync that peer raised before it exited is the report
            watchdog.blocked(self._label, start)
            watchdog.raise_verdict_on_exit()  # one about an earlier wait of this process, too
            raise RuntimeError(
                f"[rank {self._global_ranks[self.rank]}] rank {self._global_ranks[r]} (pid {self._pids[r]}) "
                f"exited while this rank waited for it in a shared-memory {what}. HINT: if that rank failed, "
                "see its output for its error; if it finished, it ran fewer training steps or forwards than "
                "this rank (give every rank the same number of batches)."
            )
        watchdog.blocked(self._label, start)
        if time.monotonic() - start > self.timeout:
            raise RuntimeError(
                f"[rank {self._global_ranks[self.rank]}] waited {self.timeout:.0f} s for rank "
                f"{self._global_ranks[r]} in a shared-memory {what}. HINT: every rank must issue the same "
                "collectives in the same order; a rank stuck elsewhere (data loading, a different code "
                "path) stalls the others."
            )

    def _mismatch(
        self, r: int, slot: int, theirs: tuple[int, ...], op: int, numel: int, dtype: torch.dtype
    ) -> str:
        def describe(code: int, n: int, d: int, where: str) -> str:
            name = _OPS[code] if 0 <= code < len(_OPS) else f"collective #{code}"
            dt = DTYPES[d] if 0 <= d < len(DTYPES) else f"dtype #{d}"
            return where or f"{name} of {n} {dt} elements"

        here = self._label_bytes.rstrip(b"\0").decode(errors="replace")
        there = self._segments[r].read_cstring(_SLOT_LABEL[slot], _LABEL_BYTES)
        me, peer = self._global_ranks[self.rank], self._global_ranks[r]
        return (
            f"[rank {me}] ranks issued different collectives:\n"
            f"  rank {me}: {describe(op, numel, DTYPES.index(dtype), here)}\n"
            f"  rank {peer}: {describe(theirs[0], theirs[1], theirs[2], there)}\n"
            "HINT: every rank must run the same units in the same order (the same forward code path and the "
            "same number of forward/backward calls); for evaluation loops of unequal length use flatshard.join."
        )

    def _per_step(self, dtype: torch.dtype, parts: int = 1) -> int:
        """Elements one rank sends in a step, split in ``parts`` equal, 64-byte aligned parts."""
        per_part = (self.slot_bytes // parts) // 64 * 64
        return max(1, per_part // dtype.itemsize)

    def _steps(self, n: int, per: int) -> Iterator[tuple[int, int, int]]:
        """``(start, end, slot)`` of each step that moves elements ``[0, n)``, ``per`` at a time."""
        for c0 in range(0, n, per):
            yield c0, min(n, c0 + per), self._step % 2

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        n, dtype = shard.numel(), shard.dtype
        output[self.rank * n : (self.rank + 1) * n].copy_(shard)
        for c0, c1, slot in self._steps(n, self._per_step(dtype)):
            self._mine(slot, 0, c1 - c0, dtype).copy_(shard[c0:c1])
            self._publish_and_wait(0, n, dtype)
            for r in range(self.world):
                if r != self.rank:
                    output[r * n + c0 : r * n + c1].copy_(self._at(r, slot, 0, c1 - c0, dtype))

    def _all_gather_direct(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """The all-gather reading each peer's ``shard`` where it lies (see [Note: reading peers directly])."""
        n, dtype = shard.numel(), shard.dtype
        nbytes = n * dtype.itemsize
        slot = self._publish_and_wait(3, n, dtype, address=shard.data_ptr())  # every source is ready
        output[self.rank * n : (self.rank + 1) * n].copy_(shard)
        base = output.data_ptr()
        for r in range(self.world):
            if r != self.rank:
                self._read_peer(r, self._records[r][slot][3], base + r * nbytes, nbytes, dtype)
        self._publish_and_wait(4, n, dtype)  # every peer has read this rank's source: it may change again

    def _read_peer(self, r: int, address: int, into: int, nbytes: int, dtype: torch.dtype) -> None:
        read = _process_vm_readv()
        assert read is not None
        done = 0
        while done < nbytes:
            local = _IoVec(into + done, nbytes - done)
            remote = _IoVec(address + done, nbytes - done)
            got = read(self._pids[r], ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                if pid_gone(self._pids[r]):  # reported as any wait on an exited peer is
                    self._check_peer(r, time.monotonic(), 3, nbytes // dtype.itemsize, dtype)
                what = self._label.describe() if self._label is not None else f"all-gather of {nbytes} bytes"
                raise RuntimeError(
                    f"[rank {self._global_ranks[self.rank]}] reading rank {self._global_ranks[r]}'s part of {what} "
                    f"(pid {self._pids[r]}) failed: {os.strerror(err) if err else 'no bytes read'}. HINT: if that "
                    "rank exited, see its output; set FLATSHARD_SHM=0 to use the process group's backend instead."
                )
            done += got

    def _reduce_scatter(self, output: torch.Tensor, full: torch.Tensor | FlatPieces) -> None:
        n, dtype, world, me = output.numel(), output.dtype, self.world, self.rank
        source = full if isinstance(full, FlatPieces) else FlatPieces.of(full)
        per = self._per_step(dtype, world)
        part = per * dtype.itemsize  # bytes of the part of a slot meant for one destination
        for c0, c1, slot in self._steps(n, per):
            m = c1 - c0
            for r in range(world):
                if r != me:
                    source.copy_into(self._mine(slot, r * part, m, dtype), r * n + c0)
            self._publish_and_wait(1, n, dtype)
            out = output[c0:c1]
            for r in range(world):  # added in rank order, as _sum_into does
                if r == me:
                    (source.copy_into if r == 0 else source.add_into)(out, me * n + c0)
                elif r == 0:
                    out.copy_(self._at(r, slot, me * part, m, dtype))
                else:
                    out.add_(self._at(r, slot, me * part, m, dtype))
        if source is full:  # autograd's gradients: free them now, not when the training thread waits
            source.release()

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        n, dtype = tensor.numel(), tensor.dtype
        for c0, c1, slot in self._steps(n, self._per_step(dtype)):
            self._mine(slot, 0, c1 - c0, dtype).copy_(tensor[c0:c1])
            self._publish_and_wait(2, n, dtype)
            # every rank adds the same values (its own from its slot) in the same order: equal results
            _sum_into(tensor[c0:c1], [self._at(r, slot, 0, c1 - c0, dtype) for r in range(self.world)])


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _process_vm_readv() -> Callable[..., int] | None:
    """libc's ``process_vm_readv`` on Linux x86-64, else ``None``."""
    c = libc() if platform.machine() in ("x86_64", "AMD64") else None
    fn = getattr(c, "process_vm_readv", None) if c is not None else None
    if fn is None:
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn  # type: ignore[no-any-return]


def _agree_on_direct_reads(group: ShmGroup, pg: ProcessGroup, own: Segment, wanted: bool) -> bool:
    """Collective: whether every rank of ``pg`` can read every peer's memory (see [Note: reading peers
    directly]), and wants to. Each rank reads a word of each peer's segment through its peer's address space."""
    read = _process_vm_readv() if wanted else None
    assert own.bytes is not None
    addresses: list[Any] = [None] * group.world
    dist.all_gather_object(addresses, own.bytes.data_ptr(), group=pg)
    ok = read is not None
    probe = ctypes.c_int64()
    for r, address in enumerate(addresses):
        if r == group.rank or read is None or not ok:
            continue
        local, remote = _IoVec(ctypes.addressof(probe), 8), _IoVec(address, 8)
        ok = read(group._pids[r], ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    return bool(flag.item())


def _stopped(cause: BaseException) -> BaseException:
    """The error of a collective issued after an earlier one failed (the ranks are out of step)."""
    kind = watchdog.DesyncError if isinstance(cause, watchdog.DesyncError) else RuntimeError
    return kind(f"flatshard shared-memory collectives stopped: {cause}")


def _sum_into(out: torch.Tensor, terms: Sequence[torch.Tensor]) -> None:
    """``out = terms[0] + terms[1] + ...``, added in list (rank) order."""
    out.copy_(terms[0])
    for term in terms[1:]:
        out.add_(term)


def anonymous_segments() -> bool:
    """Whether this process can make segments its peers open (see [Note: segments without names])."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def exchange_segments(
    group: ProcessGroup | None,
    nbytes: int,
    kind: str,
    possible: bool,
    open_peers: bool,
    info: dict[str, Any],
    reserve_if: Callable[[list[dict[str, Any]]], bool] | None = None,
) -> tuple[list[dict[str, Any]], Segment | None, dict[int, Segment]]:
    """Collective over ``group``: each rank creates a segment of ``nbytes`` and the ranks map each other's.

    A rank creates its segment when ``possible`` (and :func:`anonymous_segments` and ``FLATSHARD_SHM`` is not
    ``0``), then every rank shares its path and ``info``; ranks with ``open_peers`` map the others'. If any
    rank could not create, reserve or map, or the ranks are on several hosts, every rank gets ``(everyone,
    None, {})`` and nothing stays mapped: all ranks decide alike, so none waits on a segment another dropped.
    A segment's pages are reserved (:meth:`Segment.reserve`) when it is created, or, with ``reserve_if``, only
    if ``reserve_if(everyone)`` says this rank will write to it: a segment nobody writes costs no memory.
    Nothing is left in ``/dev/shm``, whatever happens (see [Note: segments without names]); ``kind`` names the
    segment in error messages. Returns every rank's ``info`` (with ``host``, ``path``, ``error``), this rank's
    segment and its peers'.
    """
    own: Segment | None = None
    error = ""
    peers: dict[int, Segment] = {}
    usable = done = False
    try:
        if possible and env_flag("FLATSHARD_SHM") and anonymous_segments():
            remove_stale_segments()  # names earlier versions left (see [Note: segments without names])
            try:
                own = Segment(None, nbytes, create=True)
                if reserve_if is None:
                    own.reserve()
            except (OSError, ValueError, RuntimeError) as err:
                if own is not None:
                    own.close()
                    own = None
                error = f"{kind} segment: {type(err).__name__}: {err}"
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = {
            **info,
            "host": host_key(),
            "path": own.path if own is not None else None,
            "identity": own.identity if own is not None else None,
            "error": error,
        }
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        usable = all(e["path"] for e in everyone) and len({e["host"] for e in everyone}) == 1
        if usable:  # the same on every rank: each joins the all_reduce below
            if own is not None and reserve_if is not None and reserve_if(everyone):
                try:
                    own.reserve()
                except OSError:
                    usable = False
            if open_peers and usable:
                try:
                    for r, e in enumerate(everyone):
                        if r != rank:
                            peers[r] = _open_peer(e, nbytes)
                except (OSError, ValueError, RuntimeError):
                    usable = False
            flag = torch.tensor([int(usable)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            usable = bool(flag.item())
        done = True
    finally:
        if own is not None:  # every peer has mapped it, or gave up: no other process may open it now
            own.unpublish()
        if not (done and usable):
            for seg in (*peers.values(), *([own] if own is not None else [])):
                seg.close()
    if usable and own is not None:
        return everyone, own, peers
    return everyone, None, {}


def _open_peer(entry: dict[str, Any], nbytes: int) -> Segment:
    """Map a peer's segment from its published path, refusing any other file found there."""
    seg = Segment(entry["path"], nbytes, create=False)
    if list(seg.identity) != list(entry["identity"]):
        seg.close()
        raise OSError(errno.ESTALE, f"{entry['path']} is no longer the peer's segment")
    return seg


def shm_group(
    group: ProcessGroup | None, slot_bytes: int | None = None, direct: bool = True
) -> ShmGroup | None:
    """The shared-memory transport of ``group`` (``None``: the default group), set up on first use.

    Collective on first call for a group: every rank of the group must call it at the same point (``shard()``
    does, for its groups). Returns ``None`` where the group's backend must be used (see [Note: shared-memory
    collectives]). The channel belongs to the group's state and is closed with it (see [Note: state per
    process group]). ``slot_bytes`` and ``direct`` (``False``: all-gathers copy through the slots even where
    peers' memory can be read, see [Note: reading peers directly]) apply to the first call, which sets it up.
    """
    state = state_of(group)
    if not state.channel_agreed:
        pg = group if group is not None else dist.group.WORLD
        state.channel = _setup(pg, slot_bytes or DEFAULT_SLOT_BYTES, direct)
        state.channel_agreed = True
    return state.channel


def _setup(pg: ProcessGroup, slot_bytes: int, direct: bool) -> ShmGroup | None:
    world = dist.get_world_size(pg)
    if world == 1:
        return None
    nbytes = _HEADER + 2 * slot_bytes
    everyone, own, peers = exchange_segments(
        pg, nbytes, "comm", possible=_futex() is not None, open_peers=True, info={"pid": os.getpid()}
    )
    if own is None:
        return None
    global_ranks = [dist.get_global_rank(pg, r) for r in range(world)]
    pids = [e["pid"] for e in everyone]
    group = ShmGroup(dist.get_rank(pg), world, own, peers, pids, global_ranks, slot_bytes, DEFAULT_TIMEOUT_S)
    group.direct = _agree_on_direct_reads(group, pg, own, direct)
    return group
