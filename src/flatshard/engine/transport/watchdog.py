"""Finding a desync: ranks whose collectives no longer pair up raise within a bounded time, naming where each waits.

[Note: finding a desync]
Collectives pair up by issue order: when one rank skips a training forward, runs a different unit, or goes
on to its epoch-end metric reduction while another still gathers a unit, every rank ends up waiting for a
partner that never comes. Left to the process group that is a silent hang until its timeout (30 minutes by
default). flatshard reports it instead, within ``desync_timeout`` seconds (60 by default) of the last
progress, on every rank that waits in one of its collectives, with a table naming what every rank waits
in. Built from what torch.distributed provides and the shared-memory transport's own wait loop:

* **Labels.** Every flat collective carries a :class:`Label`: its kind, size and dtype, its number on its
  group (the n-th flat collective this rank issued on those ranks) and where it was issued (the unit's
  module path, ``forward``/``backward``/``state``, the root's training step).
* **Waits that can look up.** The shared-memory transport already wakes every half second while it waits
  for a peer; a gloo collective is waited on in slices (``Work.wait(timeout)``, which leaves the work
  pending). At each wake-up the waiter records "blocked in <label> since <t>" and raises if a verdict is
  in.
* **Heartbeat.** One daemon thread per process publishes this rank's state in the default group's c10d
  store every ``beat`` seconds (``flatshard/desync/<rank>``): blocked in a flat collective (the label and
  for how long), blocked in a collective of torch.distributed called by someone else (found by looking at
  the main thread's Python frames: a metric reduction, a barrier, flatshard's own small all-reduces), or
  running. A rank whose heartbeat stops advancing (a process stopped, dead, or holding the interpreter
  lock) is counted as blocked.
* **Verdict.** A rank blocked for ``limit / 2`` reads every rank's state. Only when *every* rank is blocked
  in a collective for about that long, and they are not all in the same flat collective, is it a desync:
  no rank can make progress, so none ever will. The table is written to the store (one verdict for all)
  and every rank's flat-collective wait raises :class:`DesyncError` with it. A slow rank is never
  reported: while any rank runs (a long step, a checkpoint being written, a data loader stall) the others
  keep waiting, up to the process group's own timeout.

A rank blocked in a collective of torch.distributed (not flatshard's) cannot be interrupted from another
thread (gloo's ``abort`` does not wake a waiting ``barrier``); its heartbeat logs the verdict, and its
collective fails as soon as the ranks that raised exit. NCCL collectives do not block the CPU (their wait is
a stream dependency); NCCL's own watchdog (``TORCH_NCCL_*`` timeouts and flight recorder) covers them,
and the heartbeat still logs the positions of ranks blocked in flatshard's CPU-side waits.
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
from typing import Any, NamedTuple

import torch.distributed as dist

__all__ = [
    "DEFAULT_LIMIT_S",
    "DesyncError",
    "Label",
    "blocked",
    "configure",
    "limit",
    "start",
    "unblocked",
    "verdict",
    "wait_collective",
    "wait_sliced",
    "wait_whole",
]

log = logging.getLogger("flatshard")

DEFAULT_LIMIT_S = 60.0
_PREFIX = "flatshard/desync/"
_VERDICT_KEY = _PREFIX + "verdict"
_C10D_DIR = os.sep.join(("torch", "distributed", ""))


class DesyncError(RuntimeError):
    """Ranks wait in collectives that can never pair up; the message names each rank's position."""


class Label(NamedTuple):
    """Where a flat collective was issued, for error messages (see [Note: finding a desync])."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    numel: int  # elements this rank sends
    dtype: str
    group: tuple[int, ...]  # global ranks of its group
    seq: int  # the n-th flat collective this rank issued on that group (1-based)
    where: tuple[str, str, int] | None  # (unit path, phase, root's training step), or None: outside a step

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

    def key(self) -> list[Any]:
        """What must be equal on two ranks waiting in the same collective."""
        return [self.kind, self.numel, self.dtype, list(self.group), self.seq]


@dataclasses.dataclass
class _Watchdog:
    limit: float | None = DEFAULT_LIMIT_S
    # thread ident -> (label, monotonic time the wait began): this process's waits in flat collectives
    waits: dict[int, tuple[Label, float]] = dataclasses.field(default_factory=dict)
    verdict: str | None = None
    thread: threading.Thread | None = None
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


_STATE = _Watchdog()


def configure(limit_s: float | None) -> None:
    """Set the no-progress limit in seconds for this process (``None``: never report, wait as the process
    group does). The last ``shard()`` call's ``desync_timeout`` wins; ``FLATSHARD_DESYNC_TIMEOUT`` overrides."""
    env = os.environ.get("FLATSHARD_DESYNC_TIMEOUT")
    if env is not None:
        limit_s = None if env.strip().lower() in ("", "0", "none", "off") else float(env)
    _STATE.limit = limit_s


def limit() -> float | None:
    return _STATE.limit


def verdict() -> str | None:
    """The desync report, once one is in (every flat-collective wait raises it)."""
    return _STATE.verdict


def _beat() -> float:
    assert _STATE.limit is not None
    return min(5.0, max(0.05, _STATE.limit / 12))


def wait_slice() -> float:
    """How long a waiter blocks before it looks for a verdict again."""
    return min(0.5, _beat()) if _STATE.limit is not None else 0.5


def blocked(label: Label | None, since: float) -> None:
    """Called by a waiter that woke up with its collective still pending: record it, raise on a verdict."""
    if label is not None:
        _STATE.waits[threading.get_ident()] = (label, since)
    if _STATE.verdict is not None:
        raise DesyncError(_STATE.verdict)


def unblocked() -> None:
    """The calling thread's wait completed."""
    _STATE.waits.pop(threading.get_ident(), None)


def wait_collective(work: Any, what: str, group: Any = None) -> None:
    """Wait for a torch.distributed ``work`` (issued with ``async_op=True``) the way flatshard waits for its
    own collectives: in slices, so a desync raises :class:`DesyncError` instead of hanging. ``what`` names
    the collective in the report (``"all_reduce of a logged value (sync_dist)"``). For the strategies'
    barriers and reductions; a NCCL work is waited on plainly (its wait does not block the CPU for long).
    """
    if _STATE.limit is None or "nccl" in str(dist.get_backend(group)):
        work.wait()
        return
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    wait_sliced(work, Label(what, 0, "", ranks, -1, None))


def wait_sliced(work: Any, label: Label | None) -> None:
    """Wait for a c10d ``work`` in slices of :func:`wait_slice` seconds (``Work.wait(timeout)`` leaves it
    pending), recording the wait and raising :class:`DesyncError` once a verdict is in. An error of the
    work itself after a verdict (the ranks that raised have left) is reported as the desync it was."""
    since = time.monotonic()
    piece = datetime.timedelta(seconds=wait_slice())
    try:
        while True:
            try:
                work.wait(piece)
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower() or work.is_completed():
                    _raise_verdict(err)
                    raise
            blocked(label, since)
    finally:
        unblocked()


def wait_whole(work: Any, label: Label | None) -> None:
    """Wait for a c10d ``work`` whose ``wait`` does the work itself and ignores a timeout (gloo's
    ``reduce_scatter``): publish the position first, so a desync report names it, then block. The ranks that
    raise leave, which ends this wait with an error; it is reported as the desync it was."""
    blocked(label, time.monotonic())
    try:
        work.wait()
    except RuntimeError as err:
        _raise_verdict(err)
        raise
    finally:
        unblocked()


def _raise_verdict(err: BaseException) -> None:
    """After a verdict, a collective's error is the desync's doing: raise it as :class:`DesyncError`."""
    if _STATE.verdict is not None:
        raise DesyncError(_STATE.verdict) from err


def start() -> None:
    """Start the heartbeat thread (idempotent; nothing without a multi-rank default group or a limit)."""
    if _STATE.limit is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() < 2 or (_STATE.thread is not None and _STATE.thread.is_alive()):
        return
    _STATE.stop.clear()
    _STATE.thread = threading.Thread(target=_heartbeat, name="flatshard-heartbeat", daemon=True)
    _STATE.thread.start()


def _stop() -> None:
    _STATE.stop.set()
    if _STATE.thread is not None:
        _STATE.thread.join(timeout=1.0)


atexit.register(_stop)


# -- the heartbeat thread ----------------------------------------------------------------------------


class _Peer:
    """What this rank last read of a peer's heartbeat, and when (local clock) its beat last advanced."""

    def __init__(self) -> None:
        self.beat = -1
        self.changed = time.monotonic()


def _heartbeat() -> None:
    main = threading.main_thread().ident
    beat = 0
    foreign: tuple[int, int, float] | None = None  # (frame id, f_lasti, first seen) of a c10d call
    peers: dict[int, _Peer] = {}
    while not _STATE.stop.wait(_beat() if _STATE.limit is not None else 1.0):
        if _STATE.limit is None or not dist.is_initialized():
            continue
        try:
            store = dist.distributed_c10d._get_default_store()
            rank, world = dist.get_rank(), dist.get_world_size()
        except (RuntimeError, ValueError, AttributeError):
            continue
        beat += 1
        now = time.monotonic()
        mine, foreign = _own_state(main, foreign, now)
        mine["beat"] = beat
        try:
            store.set(f"{_PREFIX}{rank}", json.dumps(mine))
            if _STATE.verdict is None and store.check([_VERDICT_KEY]):
                _adopt(store.get(_VERDICT_KEY).decode())
            if _STATE.verdict is None and mine["blocked_s"] >= _STATE.limit / 2:
                _evaluate(store, rank, world, mine, peers)
        except Exception:  # a store going away at shutdown, a peer gone: never crash the process
            continue
        finally:
            del store


def _own_state(
    main: int | None, foreign: tuple[int, int, float] | None, now: float
) -> tuple[dict[str, Any], Any]:
    waits = list(_STATE.waits.values())
    if waits:
        label, since = min(waits, key=lambda w: w[1])
        return {
            "state": "flat",
            "where": label.describe(),
            "key": label.key(),
            "blocked_s": now - since,
        }, None
    frame = sys._current_frames().get(main) if main is not None else None
    call = _c10d_call(frame)
    if call is None:
        return {"state": "running", "where": "running (not in a collective)", "blocked_s": 0.0}, None
    ident = (id(call[0]), call[0].f_lasti)
    if foreign is None or foreign[:2] != ident:
        foreign = (*ident, now)
    return {"state": "foreign", "where": call[1], "blocked_s": now - foreign[2]}, foreign


def _c10d_call(frame: Any) -> tuple[Any, str] | None:
    """The outermost torch.distributed frame the main thread is in, and a description, or ``None``."""
    outer = named = caller = None
    f = frame
    while f is not None:
        filename = f.f_code.co_filename
        if _C10D_DIR in filename and "flatshard" not in filename:
            outer, caller = f, None
            if not filename.endswith("c10d_logger.py"):  # its decorator's wrapper: not the API's name
                named = f
        elif outer is not None:
            caller = f
            break
        f = f.f_back
    if outer is None:
        return None
    where = f"torch.distributed.{(named or outer).f_code.co_name}"
    if caller is not None:
        where += f", called from {caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name})"
    return outer, where


def _adopt(report: str) -> None:
    _STATE.verdict = report
    waits = _STATE.waits
    if not waits:  # nothing here will raise it: say it where the user looks
        log.error("%s", report)


def _evaluate(store: Any, rank: int, world: int, mine: dict[str, Any], peers: dict[int, _Peer]) -> None:
    assert _STATE.limit is not None
    keys = [f"{_PREFIX}{r}" for r in range(world)]
    if not store.check(keys):
        return  # a rank has not published yet: too early to tell
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    states = [json.loads(v) for v in values]
    states[rank] = mine
    now = time.monotonic()
    threshold = _STATE.limit / 2 - 2 * _beat()
    lines = []
    blocked_everywhere = True
    flat_keys = set()
    for r, s in enumerate(states):
        peer = peers.setdefault(r, _Peer())
        if r != rank and s["beat"] != peer.beat:
            peer.beat, peer.changed = s["beat"], now
        silent = r != rank and now - peer.changed >= max(3 * _beat(), threshold)
        if silent:
            lines.append(
                f"  rank {r}: no heartbeat for {now - peer.changed:.0f} s (its process stopped, exited, "
                f"or holds the interpreter lock); last seen: {s['where']}"
            )
            flat_keys.add("silent")
            continue
        if s["state"] == "running" or s["blocked_s"] < threshold:
            blocked_everywhere = False
            break
        kind = "waits in" if s["state"] == "flat" else "is blocked in"
        lines.append(f"  rank {r} {kind} {s['where']} for {s['blocked_s']:.0f} s")
        flat_keys.add(json.dumps(s["key"]) if s["state"] == "flat" else f"foreign {r}")
    if not blocked_everywhere or len(flat_keys) < 2:
        return  # someone runs (a slow rank), or all wait in the same collective (the transport's business)
    report = (
        f"flatshard: the ranks' collectives no longer pair up; no rank has made progress for "
        f"{_STATE.limit / 2:.0f} s or more:\n" + "\n".join(lines) + "\n"
        "HINT: every rank must run the same sharded forwards and backwards in the same order. A rank that "
        "skipped a training step or a batch (uneven data: give every rank the same number of training "
        "batches; for evaluation use flatshard.join), ran a different branch of the model, or went on to "
        "a collective of its own (a metric reduction, a barrier) leaves the others waiting. The limit is "
        "the desync_timeout option (FLATSHARD_DESYNC_TIMEOUT)."
    )
    if not store.check([_VERDICT_KEY]):
        store.set(_VERDICT_KEY, report)
    _adopt(store.get(_VERDICT_KEY).decode())
