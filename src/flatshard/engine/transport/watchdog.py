"""Finding a desync: ranks whose collectives can never pair up raise within a bounded time, naming where each waits.

[Note: finding a desync]
Collectives pair up by issue order: when one rank skips a training forward, runs a different unit, or goes
on to its epoch-end metric reduction while another still gathers a unit, every rank ends up waiting for a
partner that never comes. Left to the process group that is a silent hang until its timeout (30 minutes by
default). flatshard reports it instead, within ``desync_timeout`` seconds (60 by default), with a table naming
what every rank waits in. A report needs positive evidence that no rank can ever make progress; a rank that
might still be working is never reported (no false alarm by construction).

* **Labels.** Every flat collective carries a :class:`Label`: its kind, size and dtype, its process group (by
  name, the same on every rank), its number on that group (the n-th flat collective this rank issued there)
  and where it was issued (the unit's module path, ``forward``/``backward``/``state``, the training step).
  Each rank also remembers the signatures of the last flat collectives it *issued* per group.
* **The training thread's wait.** Only the main thread's state counts. It waits in a flat collective (or a
  barrier or reduction of the strategies, labelled the same way) in slices (``Work.wait(timeout)`` leaves
  the work pending); at each slice it records "waiting in <label> since <t>" under a wait number, and
  raises if a verdict about *that* wait is in. Otherwise the heartbeat looks at the main thread's Python
  frames: its innermost frame of a ``torch.distributed`` module being one of ``distributed_c10d``'s
  collectives (``barrier``, ``all_reduce``, ``broadcast``, ...) means it waits in that collective, called
  from the first frame outside ``distributed_c10d``; anything else (computing, writing a checkpoint,
  pickling inside ``broadcast_object_list``, DCP's planning) is *running*. Frames are told apart by their
  module's ``__name__``, never by file paths. This is the one place the package reads a call stack, and
  only for this report: it decides nothing the training computes, and it is the only way to see a wait
  that flatshard did not issue (the user's own ``dist.barrier()``) without wrapping torch's functions. If
  a torch release renames these functions, such a wait reads as *running*: no report, so the process
  group's own timeout applies, never a false alarm; ``tests/distributed/test_desync.py`` pins it.
* **Limits.** Each root's ``desync_timeout`` is the limit of the collectives on its process groups
  (:func:`configure`), kept in the group's state (see [Note: state per process group]), so it goes with the
  group; a collective on another group (a strategy's barrier, a torch.distributed call) has the smallest
  limit set on a live group, which also sets the heartbeat's pace. A wait whose limit is off (``None``) is
  never reported.
* **Heartbeat.** One daemon thread per default process group (its :class:`Monitor` is part of that group's
  state, and stops with it) publishes, every ``beat`` seconds, this rank's state in the default group's c10d
  store (``flatshard/desync/<rank>``): the wait above or "running", its duration, the
  limit of that wait and the beat interval, its process (host, boot, pid and start time), and the issued signatures. At exit it publishes "exited".
* **Verdict.** A rank waiting for ``limit / 2`` reads every rank's state. It is a desync only when
  - every rank waits in a collective for at least half of *its own* wait's limit, with a heartbeat that advanced
    within three of *its own* beat intervals; or has exited (it said so, or it is on this host and its pid
    is gone). A rank running, or silent for another reason (stopped, holding the interpreter lock in a long
    C call), or waiting for less than its half limit, means no verdict;
  - at least one rank waits in a flat collective;
  - and no wait can complete: a flat collective #n on group G can complete when every member of G has
    issued its #n with the same signature (then it is in flight, merely slow, whatever its duration); a
    torch.distributed collective can complete unless a member of its group waits in a flat collective or
    has exited (two ranks in torch.distributed collectives from different places may still pair up: that
    is not evidence). Every rank in the same long torch.distributed call, or running inside DCP, is never
    a verdict.
  The verdict names the wait of every rank it is about. Each rank adopts it only while its main thread is
  still in that very wait: a flat wait raises :class:`DesyncError`; a rank blocked inside torch.distributed
  (which cannot be interrupted from another thread) logs it, and its collective fails as soon as the ranks
  that raised exit. A verdict never outlives its wait: a later, ordinary slow step is judged afresh.

On NCCL a flat collective's wait is a stream dependency and never blocks the CPU; a rank's CPU blocks in
the all-gather rate limiter instead (``limit_all_gathers=True``, the default), waiting for the buffer freed
two gathers ago, whose free event comes after the gather that filled it. The limiter polls that event in
slices and records the wait as one in that gather (its label, with its c10d number), so the same evidence
applies: a rank that skipped a step blocks in the strategy's barrier (its position is published before the
NCCL barrier blocks), its peer in the limiter on a gather the first never issued, with the same c10d
number as the barrier or one the first never reached. The CPU fake in the fault tests models it: an event
that completes when a gloo work does.

What is not detected: a desync among ranks that all wait in torch.distributed collectives (no flat
collective involved: the process group's own timeout applies); a rank that went silent on another host
without exiting cleanly (gloo reports its closed connection at once; NCCL's watchdog covers NCCL); and on
NCCL, a rank whose CPU blocks elsewhere than in the limiter or the strategies' collectives (reading a value
back with ``item()``, ``torch.cuda.synchronize``, ``limit_all_gathers=False``): that is *running* to the
heartbeat, never evidence, and NCCL's own watchdog (``TORCH_NCCL_*`` timeouts, flight recorder) reports
the hang.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from types import MappingProxyType
from typing import Any, NamedTuple

import torch.distributed as dist

from flatshard.engine.transport.env import env_seconds
from flatshard.engine.transport.groups import GroupState, live, state_of, world_state
from flatshard.engine.transport.processes import ProcessId

__all__ = [
    "DEFAULT_LIMIT_S",
    "DesyncError",
    "Label",
    "Monitor",
    "adopt_verdict",
    "blocked",
    "configure",
    "group_limit",
    "limit",
    "note_issued",
    "raise_verdict_on_exit",
    "start",
    "unblocked",
    "verdict",
    "wait_collective",
    "wait_sliced",
    "wait_whole",
]

log = logging.getLogger("flatshard")

DEFAULT_LIMIT_S = 60.0
ENV = "FLATSHARD_DESYNC_TIMEOUT"  # see [Note: environment switches]
_PREFIX = "flatshard/desync/"
_VERDICT_KEY = _PREFIX + "verdict"
_ISSUED_KEPT = 16  # signatures of the last flat collectives issued per group, for the verdict's evidence
_NONCE = os.urandom(4).hex()  # wait numbers of this process, never those of an earlier one on the same store
_C10D = "torch.distributed.distributed_c10d"
_C10D_WRAPPERS = (_C10D, "torch.distributed.c10d_logger")
# distributed_c10d's collectives: a main thread whose innermost torch.distributed frame is one of these waits.
_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "_all_gather_base",
        "_reduce_scatter_base",
    }
)


# Operations that may pair with each other (a NCCL barrier is an all_reduce): a wait in one family and a wait
# in another, on the same ranks, can never complete together.
_FAMILY = MappingProxyType(
    {
        "monitored_barrier": "all_reduce",
        "barrier": "all_reduce",
        "all_reduce_coalesced": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "all_gather_coalesced": "all_gather",
        "all_gather_object": "all_gather",
        "_all_gather_base": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter",
        "broadcast_object_list": "broadcast",
        "gather_object": "gather",
        "scatter_object_list": "scatter",
        "all_to_all_single": "all_to_all",
        "send": "p2p",
        "recv": "p2p",
        "batch_isend_irecv": "p2p",
    }
)


class DesyncError(RuntimeError):
    """Ranks wait in collectives that can never pair up; the message names each rank's position."""


class Label(NamedTuple):
    """Where a flat collective was issued, for error messages (see [Note: finding a desync])."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    numel: int  # elements this rank sends
    dtype: str
    group: tuple[int, ...]  # global ranks of its group
    seq: int  # the n-th flat collective this rank issued on that group (1-based); -1: a strategy collective
    where: tuple[str, str, int] | None  # (unit path, phase, root's training step), or None: outside a step
    name: str = ""  # the process group's name (the same on every rank), "" if unknown
    op: str = ""  # a strategy collective's torch.distributed operation ("barrier", "all_reduce")
    c10d_seq: int = 0  # its number among the process group's own collectives (0: not a c10d collective)
    state: GroupState | None = None  # its process group's state (its limit); None: the process-wide limit

    def describe(self) -> str:
        if self.seq < 0:  # a collective of the strategies (wait_collective): its kind says what it is
            return f"{self.kind} on ranks {list(self.group)}"
        span = (
            f"ranks {self.group[0]}-{self.group[-1]}" if len(self.group) > 2 else f"ranks {list(self.group)}"
        )
        if self.where is None:
            place = "outside forward/backward (a state dict, unshard_params or checkpoint gather)"
        else:
            unit, phase, step = self.where
            place = f"unit {unit!r}, {phase}" + (f", step {step}" if step > 0 else "")
        return f"{self.kind} of {self.numel} {self.dtype} elements ({place}; flat collective #{self.seq} on {span})"

    def signature(self) -> list[Any]:
        """What two ranks' n-th flat collectives on one group must share to pair up."""
        return [self.kind, self.numel, self.dtype]


@dataclasses.dataclass
class _Wait:
    label: Label
    since: float  # time.monotonic() when the wait began
    ident: str  # this process's wait number: a verdict names the waits it is about


@dataclasses.dataclass
class Monitor:
    """The desync detector's state in one process: the main thread's wait, the verdict adopted and the heartbeat
    thread. Owned by the default process group's state (its store is where the heartbeat publishes; see [Note:
    state per process group]): a new default group starts a new monitor, and the old one's heartbeat stops."""

    wait: _Wait | None = None  # the main thread's wait in a labelled collective
    waits: int = 0  # wait numbers handed out (labelled and torch.distributed waits alike)
    verdict: str | None = None  # the last report adopted
    verdict_wait: str | None = None  # the wait of this process it is about
    verdict_at: float | None = None  # when it was adopted (monotonic)
    thread: threading.Thread | None = None
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self) -> None:
        """Stop the heartbeat (waiting up to a second for it, unless called from it)."""
        self.stopped.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def next_wait(self) -> str:
        self.waits += 1
        return f"{_NONCE}:{self.waits}"


def _monitor() -> Monitor | None:
    """The default group's monitor (made on first use), or ``None`` without an initialized default group."""
    state = world_state()
    if state is None:
        return None
    if state.monitor is None:
        state.monitor = Monitor()
    monitor: Monitor = state.monitor
    return monitor


def configure(limit_s: float | None, groups: Any = (None,)) -> None:
    """Set the no-progress limit in seconds of the collectives on ``groups`` (process groups; ``None``: the
    default group), ``None`` meaning never report (wait as the process group does). ``shard()`` sets its root's
    ``desync_timeout`` for the root's groups, so two roots on different groups keep their own limits (on one
    group the last ``shard()`` call's value holds); the limit lives in the group's state and goes with it.
    ``FLATSHARD_DESYNC_TIMEOUT`` overrides every limit and is checked like the argument."""
    value = env_seconds(ENV, limit_s)
    if not (dist.is_available() and dist.is_initialized()):
        return  # no collective to watch
    for group in groups:
        state = state_of(group)
        state.desync_limit, state.limit_set = value, True


def limit() -> float | None:
    """The smallest limit set on a live process group (``DEFAULT_LIMIT_S`` before any; ``None`` if every one is
    off): the one for collectives on groups no root set, and what the heartbeat's pace follows."""
    limits = [state.desync_limit for _, state in live() if state.limit_set]
    if not limits:
        return env_seconds(ENV, DEFAULT_LIMIT_S)
    values = [v for v in limits if v is not None]
    return min(values) if values else None


def group_limit(state: GroupState | None) -> float | None:
    """The limit of collectives on the group whose state is ``state`` (see :func:`configure`)."""
    return state.desync_limit if state is not None and state.limit_set else limit()


def verdict() -> str | None:
    """The last desync report this process adopted (its waits raised it), or ``None``."""
    monitor = _monitor()
    return monitor.verdict if monitor is not None else None


def note_issued(label: Label) -> None:
    """Record a flat collective this rank issued (its signature is the evidence a verdict compares)."""
    state = label.state
    if label.seq > 0 and state is not None:
        if state.issued is None:
            state.issued = deque(maxlen=_ISSUED_KEPT)
        kept = state.issued
        family = _FAMILY.get(label.op or label.kind, label.op or label.kind)
        kept.append([label.seq, *label.signature(), label.c10d_seq, family])


def _beat() -> float:
    smallest = limit()
    return min(5.0, max(0.05, smallest / 12)) if smallest is not None else 1.0


def wait_slice() -> float:
    """How long a waiter blocks before it looks for a verdict again."""
    return min(0.5, _beat())


def blocked(label: Label | None, since: float) -> None:
    """Called by a waiter whose collective is still pending: record the main thread's wait, and raise
    :class:`DesyncError` if a verdict about this wait is in. Another thread (the shared-memory transport's
    worker) records nothing and raises if a verdict came in while it waited."""
    monitor = _monitor()
    if monitor is None:
        return
    if threading.current_thread() is not threading.main_thread():
        at = monitor.verdict_at
        if monitor.verdict is not None and at is not None and at >= since:
            raise DesyncError(monitor.verdict)
        return
    wait = monitor.wait
    if label is not None and (wait is None or wait.since != since or wait.label != label):
        wait = monitor.wait = _Wait(label, since, monitor.next_wait())
    if wait is not None and monitor.verdict is not None and monitor.verdict_wait == wait.ident:
        _let_peers_learn()
        raise DesyncError(monitor.verdict)


def _let_peers_learn() -> None:
    """Give the other ranks a verdict names two heartbeats to adopt it before this rank raises it and leaves: a
    rank in a collective flatshard cannot interrupt reads it from the store alone, which may go with this process."""
    found = _stored_verdict()
    if found is None:
        return
    me = str(dist.get_rank())
    others = {r: w for r, w in found.get("waits", {}).items() if r != me}
    deadline = time.monotonic() + 2 * _beat() + 0.5
    try:
        store = dist.distributed_c10d._get_default_store()
        while others and time.monotonic() < deadline:
            for r, wait in list(others.items()):
                entry = json.loads(store.get(f"{_PREFIX}{r}").decode())
                if entry.get("adopted") == wait or entry.get("state") == "exited":
                    del others[r]
            if others:
                time.sleep(0.05)
    except Exception:  # the store or a peer is gone: nothing more to tell
        return


def unblocked() -> None:
    """The calling thread's wait completed."""
    if threading.current_thread() is threading.main_thread():
        monitor = _monitor()
        if monitor is not None:
            monitor.wait = None


def current_wait() -> Label | None:
    """The labelled collective the main thread waits in now, as the heartbeat publishes it (``None``: none)."""
    monitor = _monitor()
    wait = monitor.wait if monitor is not None else None
    return wait.label if wait is not None else None


def wait_collective(work: Any, what: str, group: Any = None, op: str = "") -> None:
    """Wait for a torch.distributed ``work`` (issued with ``async_op=True``) the way flatshard waits for its
    own collectives: in slices, so a desync raises :class:`DesyncError` instead of hanging. ``what`` names
    the collective in the report (``"all_reduce of a logged value (sync_dist)"``), ``op`` the
    torch.distributed operation (``"barrier"``). For the strategies' barriers and reductions; a NCCL work
    cannot be waited on in slices, so its position is published and the wait blocks (a NCCL barrier's does).
    """
    pg = group if group is not None else dist.group.WORLD
    state = state_of(pg)
    if group_limit(state) is None:
        work.wait()
        return
    label = Label(what, 0, "", state.ranks, -1, None, state.name, op, c10d_seq(pg), state)
    if "nccl" in str(dist.get_backend(group)):
        wait_whole(work, label)  # a NCCL barrier blocks the CPU in wait(): say where first
        return
    wait_sliced(work, label)


def group_name(group: Any) -> str:
    """A process group's name (the same on every rank), or "" where torch does not say."""
    try:
        return str(group.group_name)
    except (AttributeError, RuntimeError):
        return ""


def c10d_seq(group: Any) -> int:
    """How many collectives this rank has issued on ``group`` (torch's own count), or 0 if unknown."""
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return 0


def wait_sliced(work: Any, label: Label | None) -> None:
    """Wait for a c10d ``work`` (or a shared-memory work) in slices of :func:`wait_slice` seconds
    (``Work.wait(timeout)`` leaves it pending), recording the wait and raising :class:`DesyncError` once a
    verdict about it is in. An error of the work itself after such a verdict (the ranks that raised have
    left) is reported as the desync it was."""
    since = time.monotonic()
    piece = datetime.timedelta(seconds=wait_slice())
    try:
        while True:
            try:
                work.wait(piece)
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower():
                    _raise_verdict(err, since)
                    raise
                if work.is_completed():  # done just after the slice ran out: wait() returns it, or its error
                    continue
            blocked(label, since)
    finally:
        unblocked()


def wait_whole(work: Any, label: Label | None) -> None:
    """Wait for a c10d ``work`` whose ``wait`` does the work itself and ignores a timeout (gloo's
    ``reduce_scatter``): publish the position first, so a desync report names it, then block. The ranks that
    raise leave, which ends this wait with an error; it is reported as the desync it was."""
    since = time.monotonic()
    blocked(label, since)
    try:
        work.wait()
    except RuntimeError as err:
        _raise_verdict(err, since)
        raise
    finally:
        unblocked()


def adopt_verdict() -> None:
    """Read the store's verdict now, and adopt it if it is about the main thread's wait: a peer that raised it
    may have exited before this rank's heartbeat read it, and its exit must not hide the desync."""
    monitor = _monitor()
    wait = monitor.wait if monitor is not None else None
    if monitor is None or wait is None or limit() is None:
        return
    found = _stored_verdict()
    if found is not None:
        _adopt(monitor, found, dist.get_rank(), {"wait": wait.ident, "state": "flat"})


def _stored_verdict() -> dict[str, Any] | None:
    """The verdict in the default group's store, or ``None`` (none yet, or the store is gone with the peers:
    then the collective's own error stands)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([_VERDICT_KEY]):
            return None
        found: dict[str, Any] = json.loads(store.get(_VERDICT_KEY).decode())
    except Exception:
        return None
    return found


def _raise_verdict(err: BaseException, since: float) -> None:
    """A collective's error after a verdict adopted during this wait is the desync's doing; so is one after a
    peer left, if the store holds a verdict about any wait of this process (see :func:`raise_verdict_on_exit`)."""
    adopt_verdict()
    monitor = _monitor()
    at = monitor.verdict_at if monitor is not None else None
    if monitor is not None and monitor.verdict is not None and at is not None and at >= since:
        raise DesyncError(monitor.verdict) from err
    raise_verdict_on_exit(err)


def raise_verdict_on_exit(err: BaseException | None = None) -> None:
    """A peer this rank waits for has exited (or the collective failed as peers left): if the store holds a
    verdict naming a wait of this process, raise it as :class:`DesyncError`.

    The verdict is the better report: the peer raised it and left. It need not be about the wait this rank is
    in now, only about one of this process's (its wait ids carry this process's nonce, so a verdict from an
    earlier run on the same store never matches): under load a rank may publish its next wait, or learn of
    the exit from a worker thread before the main thread waits, after the verdict named the previous one.
    """
    monitor = _monitor()
    if monitor is None or limit() is None:
        return
    found = _stored_verdict()
    if found is None:
        return
    about = found.get("waits", {}).get(str(dist.get_rank()))
    if not isinstance(about, str) or not about.startswith(f"{_NONCE}:"):
        return
    if monitor.verdict_wait != about:
        monitor.verdict, monitor.verdict_wait, monitor.verdict_at = found["report"], about, time.monotonic()
    if err is None:
        raise DesyncError(found["report"])
    raise DesyncError(found["report"]) from err


def start() -> None:
    """Start the default group's heartbeat thread (idempotent; nothing without a multi-rank default group or a
    limit). It stops with its group's state (see [Note: state per process group])."""
    monitor = _monitor()
    if monitor is None or limit() is None or dist.get_world_size() < 2:
        return
    if monitor.thread is not None and monitor.thread.is_alive():
        return
    monitor.stopped.clear()
    monitor.thread = threading.Thread(
        target=_heartbeat, args=(monitor,), name="flatshard-heartbeat", daemon=True
    )
    monitor.thread.start()


def _stop() -> None:
    """At exit: stop beating and tell the peers this process is gone (positive evidence for them)."""
    state = world_state()
    monitor = state.monitor if state is not None else None
    if monitor is None or monitor.thread is None:
        return
    monitor.stop()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_PREFIX}{dist.get_rank()}", json.dumps({"state": "exited", "beat": -1}))
    except Exception:  # the store may be gone already
        pass


atexit.register(_stop)


# -- the heartbeat thread ----------------------------------------------------------------------------


class _Peer:
    """What this rank last read of a peer's heartbeat, and when (local clock) its beat last advanced."""

    def __init__(self) -> None:
        self.beat = -1
        self.changed = time.monotonic()


@dataclasses.dataclass
class _Foreign:
    """The main thread's current wait inside a torch.distributed collective, as the heartbeat saw it."""

    frame: tuple[int, int]  # (id of the collective's frame, its f_lasti)
    since: float
    ident: str


def _heartbeat(monitor: Monitor) -> None:
    main = threading.main_thread().ident
    beat = 0
    foreign: _Foreign | None = None
    peers: dict[int, _Peer] = {}
    me = ProcessId.mine().to_json()
    while not monitor.stopped.wait(_beat()):
        if _monitor() is not monitor:
            return  # its default group is gone: a new one has a monitor of its own
        if limit() is None:
            continue
        try:
            store = dist.distributed_c10d._get_default_store()
            rank, world = dist.get_rank(), dist.get_world_size()
        except (RuntimeError, ValueError, AttributeError):
            continue
        beat += 1
        states = live()  # a later group of a name overrides an earlier one's entries
        mine, foreign = _own_state(monitor, main, foreign, time.monotonic())
        mine.update(
            beat=beat,
            interval=_beat(),
            proc=me,
            c10d={**{state.name: c10d_seq(pg) for pg, state in states}, **mine.get("c10d", {})},
            issued={state.name: list(state.issued) for _, state in states if state.issued},
        )
        del states  # no process group is held across beats: each goes when destroyed
        mine["adopted"] = (
            monitor.verdict_wait
        )  # what a peer raising a verdict waits to see (_let_peers_learn)
        try:
            store.set(f"{_PREFIX}{rank}", json.dumps(mine))
            if store.check([_VERDICT_KEY]):
                _adopt(monitor, json.loads(store.get(_VERDICT_KEY).decode()), rank, mine)
                if mine["adopted"] != monitor.verdict_wait:  # tell it now, not a beat later
                    mine["adopted"] = monitor.verdict_wait
                    store.set(f"{_PREFIX}{rank}", json.dumps(mine))
            own = mine["limit"]
            if monitor.verdict_wait != mine.get("wait") and own is not None and mine["blocked_s"] >= own / 2:
                _evaluate(monitor, store, rank, world, mine, peers)
        except Exception:  # a store going away at shutdown, a peer gone: never crash the process
            continue
        finally:
            del store


def _own_state(
    monitor: Monitor, main: int | None, foreign: _Foreign | None, now: float
) -> tuple[dict[str, Any], Any]:
    wait = monitor.wait
    if wait is not None:
        label = wait.label
        return {
            "state": "flat" if label.seq > 0 else "labelled",
            "where": label.describe(),
            "group": list(label.group),
            "name": label.name,
            "seq": label.seq,
            "signature": label.signature(),
            "op": _FAMILY.get(label.op or label.kind, label.op or label.kind),
            "c10d_seq": label.c10d_seq,
            "wait": wait.ident,
            "blocked_s": now - wait.since,
            "limit": group_limit(label.state),
        }, None
    frame = sys._current_frames().get(main) if main is not None else None
    call = _c10d_wait(frame)
    if call is None:
        return {
            "state": "running",
            "where": "running (not in a collective)",
            "blocked_s": 0.0,
            "limit": limit(),
        }, None
    collective, where, pg = call
    ident = (id(collective), collective.f_lasti)
    if foreign is None or foreign.frame != ident:
        foreign = _Foreign(ident, now, monitor.next_wait())
    op = _FAMILY.get(collective.f_code.co_name, collective.f_code.co_name)
    state = {"state": "collective", "where": where, "op": op, "wait": foreign.ident, "limit": limit()}
    if pg is not None:  # a blocking collective is the last one issued on its group: its number is the count
        name, seq = group_name(pg), c10d_seq(pg)
        limit_s = group_limit(_known_state(pg))
        state.update(group=_ranks(pg), name=name, c10d_seq=seq, limit=limit_s, c10d={name: seq})
    return {**state, "blocked_s": now - foreign.since}, foreign


def _module(frame: Any) -> str:
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) else ""


def _c10d_wait(frame: Any) -> tuple[Any, str, Any] | None:
    """If the main thread waits in a collective of torch.distributed: its frame, a description and its
    process group (``None`` if unknown); else ``None`` (see [Note: finding a desync])."""
    f = frame
    while f is not None and not _module(f).startswith("torch.distributed"):
        f = f.f_back
    if f is None or _module(f) != _C10D or f.f_code.co_name not in _COLLECTIVES:
        return None  # running: computing, writing, pickling, planning
    named, caller = f, f.f_back
    while caller is not None and _module(caller) in _C10D_WRAPPERS:
        if _module(caller) == _C10D and caller.f_code.co_name in _COLLECTIVES:
            named = caller  # the API that was called (broadcast_object_list, not the broadcast inside it)
        caller = caller.f_back
    where = f"torch.distributed.{named.f_code.co_name}"
    if caller is not None:
        where += f", called from {caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name})"
    return f, where, _group_of(named)


def _group_of(frame: Any) -> Any:
    try:
        group = frame.f_locals.get("group")
        group = dist.group.WORLD if group is None else group
        return group if isinstance(group, dist.ProcessGroup) else None
    except Exception:  # not a process group we can read: unknown, never evidence
        return None


def _known_state(group: Any) -> GroupState | None:
    """The state of a group the engine has used (never made here: the heartbeat only reads)."""
    return next((state for pg, state in live() if pg is group), None)


def _ranks(group: Any) -> list[int] | None:
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return None


def _adopt(monitor: Monitor, found: dict[str, Any], rank: int, mine: dict[str, Any]) -> None:
    """Take in a verdict if it is about the wait this rank is in now (a stale one never fires)."""
    about = found.get("waits", {}).get(str(rank))
    if about is None or about != mine.get("wait") or monitor.verdict_wait == about:
        return
    monitor.verdict, monitor.verdict_wait, monitor.verdict_at = found["report"], about, time.monotonic()
    if mine["state"] == "collective":  # nothing here will raise it: say it where the user looks
        log.error("%s", found["report"])


def _evaluate(
    monitor: Monitor, store: Any, rank: int, world: int, mine: dict[str, Any], peers: dict[int, _Peer]
) -> None:
    keys = [f"{_PREFIX}{r}" for r in range(world)]
    if not store.check(keys):
        return  # a rank has not published: too early to tell, or detection is off there
    before = store.get(_VERDICT_KEY) if store.check([_VERDICT_KEY]) else b""
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    states = [json.loads(v) for v in values]
    states[rank] = mine
    now = time.monotonic()
    exited: set[int] = set()
    for r, s in enumerate(states):
        if r == rank:
            continue
        peer = peers.setdefault(r, _Peer())
        if s["beat"] != peer.beat:
            peer.beat, peer.changed = s["beat"], now
        if s["state"] == "exited" or _gone(s.get("proc")):
            exited.add(r)
        elif now - peer.changed > max(3 * s["interval"], 1.0) + 2 * _beat():
            return  # silent, but not known to be gone: stopped, or holding the interpreter lock
    for r, s in enumerate(states):
        if r not in exited and (
            s["state"] == "running"
            or s.get("limit") is None  # its wait is on a group whose limit is off: never reported
            or s["blocked_s"] < s["limit"] / 2 - 2 * s["interval"]
        ):
            return  # a rank is working, or has waited too briefly to tell: it may yet come
    if not any(s["state"] in ("flat", "labelled") for r, s in enumerate(states) if r not in exited):
        return  # no collective of flatshard's: the process group's timeout applies
    if any(_can_complete(s, states, exited) for r, s in enumerate(states) if r not in exited):
        return  # a collective is in flight: slow, not stuck
    report = _report(states, exited)
    waits = {str(r): s.get("wait") for r, s in enumerate(states) if r not in exited}
    # the first verdict stored wins: a peer that decided at the same moment adopts that one too
    stored = store.compare_set(_VERDICT_KEY, before, json.dumps({"waits": waits, "report": report}))
    _adopt(monitor, json.loads(bytes(stored).decode()), rank, mine)


def _gone(proc: Any) -> bool:
    """Whether a peer's published process is known to be gone (it ran on this machine and runs no more)."""
    owner = ProcessId.from_json(proc) if isinstance(proc, str) else None
    return owner is not None and owner.gone()


def _can_complete(state: dict[str, Any], states: list[dict[str, Any]], exited: set[int]) -> bool:
    """Whether a rank's wait could still end: see [Note: finding a desync]."""
    group = state.get("group")
    if group is None:
        return True  # unknown group: no evidence
    if any(m in exited for m in group):
        return False
    if state["state"] == "flat":
        wanted = [state["seq"], *state["signature"]]
        for m in group:
            kept = states[m].get("issued", {}).get(state["name"], [])
            last = max((entry[0] for entry in kept), default=0)
            if last < state["seq"]:
                return False  # this member has not issued it
            same = [entry for entry in kept if entry[0] == state["seq"]]
            if same and same[0][: len(wanted)] != wanted:
                return False  # it issued a different collective under that number
        return True
    name, seq, op = state.get("name"), state.get("c10d_seq") or 0, state.get("op")
    if not name or seq <= 0 or op == "p2p":
        return True  # no number to compare: no evidence
    for m in group:
        theirs = states[m]
        issued = theirs.get("c10d", {}).get(name)
        if issued is None:
            return True  # this member's count is unknown: no evidence
        if issued < seq:
            return False  # it has not issued this collective, and it is blocked elsewhere
        at_same = theirs.get("name") == name and theirs.get("c10d_seq") == seq
        if at_same and theirs.get("op") not in (None, "", "p2p", op):
            return False  # its collective with this number is of another kind: they cannot pair
        for entry in theirs.get("issued", {}).get(name, []):
            if len(entry) > 5 and entry[4] == seq and entry[5] not in ("", "p2p", op):
                return False  # it issued a flat collective of another kind under this number
    return True


def _report(states: list[dict[str, Any]], exited: set[int]) -> str:
    lines = []
    for r, s in enumerate(states):
        if r in exited:
            lines.append(f"  rank {r}: exited; last seen: {s.get('where', 'its exit')}")
        elif s["state"] == "collective":
            lines.append(f"  rank {r} is blocked in {s['where']} for {s['blocked_s']:.0f} s")
        else:
            lines.append(f"  rank {r} waits in {s['where']} for {s['blocked_s']:.0f} s")
    waited = min((s["blocked_s"] for r, s in enumerate(states) if r not in exited), default=0.0)
    return (
        f"flatshard: the ranks' collectives can no longer pair up; no rank has made progress for "
        f"{waited:.0f} s or more:\n" + "\n".join(lines) + "\n"
        "HINT: every rank must run the same sharded forwards and backwards in the same order. A rank that "
        "skipped a training step or a batch (uneven data: give every rank the same number of training "
        "batches; for evaluation use flatshard.join), ran a different branch of the model, or went on to "
        "a collective of its own (a metric reduction, a barrier) leaves the others waiting. The limit is "
        f"the desync_timeout option ({ENV})."
    )
