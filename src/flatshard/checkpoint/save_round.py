"""Every rank learns how a save went, within seconds, through the default process group's c10d store.

[Note: save outcomes through the store]
A save's failure must reach every rank even when the failing rank can no longer write to the checkpoint's
storage (a full disk, a dropped connection) or has died, and without waiting out a timeout meant for slow
peers. So the ranks of a save report to each other through the c10d store of the default process group (the
store every rank reached to join the group), never through the storage being written:

- **Opening.** Every save starts with one small collective (``all_gather_object``) exchanging each rank's
  :class:`~flatshard.engine.transport.processes.ProcessId` and rank 0's id for the save. Each rank starts its
  heartbeat before it, so past the opening every rank is known and beating. A rank that is already gone
  fails this collective (the process group's own error).
- **Heartbeat.** While a save is open, a daemon thread of the save adds 1 to ``flatshard/save/alive/<rank>``
  every ``HEARTBEAT_S`` seconds.
- **Steps.** Where the ranks must agree before going on (before DCP's collectives, after the write, after the
  rename), each adds 1 to ``flatshard/save/<id>/<step>`` and waits until the count is the world size.
- **Failures.** A rank that fails posts its error as ``<id>/error/<n>`` (``n`` counts failures, from
  ``<id>/failed``); every waiting rank then raises the first one posted. While it waits, rank 0 watches every
  rank and the others watch rank 0: a rank is gone when its process, on this machine, has exited (positive
  evidence, seen within ``WATCH_S``), or when its heartbeat has not advanced for ``SILENCE_S`` seconds
  (another machine); the watcher posts the failure for it. A slow rank keeps beating and is waited for (an
  asynchronous save bounds that wait by its ``peer_timeout_s``). A store that no longer answers is the
  failure of the process that hosts it (rank 0's, unless a launcher hosts it).
- **Payloads.** An asynchronous save's ranks hand their write results to rank 0 as ``<id>/payload/<step>/<r>``.
- **Closing.** Every rank leaving a save, by success or failure, counts itself in at ``<id>/out`` and waits,
  up to ``ACK_S``, for every rank that still runs: the store's host may exit right after it leaves, and no
  rank raises a failure before rank 0 has removed what the save wrote. The last to leave deletes the save's
  keys (after a rank died they stay: a few bytes).
- **Refusals.** Checks of the arguments that one rank makes (a full file where a directory is) travel with
  the opening: every rank raises before anything is written, the refusing rank its own error unchanged.

DCP's own collectives (planning, gathering the write results) already carry one rank's exception to every
rank; a collective that fails because a peer died is reported as that peer's death. Once a save has failed,
the cleanups registered for it run on every rank (rank 0 removes the hidden directory or, at a URL, the
save's objects; each rank its own data file) unless the checkpoint was already committed, and every rank
raises one :class:`CheckpointError`: what failed, on which rank, the path, the cause, and a ``HINT:``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.storage import Location, Remote
from flatshard.engine import ProcessId, world_state

__all__ = ["HEARTBEAT_S", "SILENCE_S", "Failure", "RoundFailed", "SaveRound", "gather_for_save"]

HEARTBEAT_S = 1.0  # how often a process adds to its heartbeat
SILENCE_S = 60.0  # a rank on another machine whose heartbeat has not advanced this long is gone
WATCH_S = 0.2  # how often a waiting rank looks at the processes it watches
ACK_S = 10.0  # how long a rank leaving a save waits for the others (one still busy writing) to leave it too
_MAX_PAUSE_S = 0.1  # the longest pause between two looks at the store while waiting
_ROOT = "flatshard/save/"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _default_store() -> Any | None:
    """The default process group's store, or ``None`` without a process group of several ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


# ---------------------------------------------------------------------------------------------- heartbeat
class _Heartbeat:
    """This rank's heartbeat in one save: ``flatshard/save/alive/<rank>`` grows by 1 every ``HEARTBEAT_S`` from
    the opening until the save closes, on a daemon thread the save owns. Saves open at once (an asynchronous
    one and the next) each beat the same key: their watchers only ask that it advances."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        _beat()  # at once: peers see it before the opening collective returns
        self._thread = threading.Thread(target=self._run, name="flatshard-save-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            _beat()


def _beat() -> None:
    with contextlib.suppress(Exception):  # a store going away (its host process exited)
        store = _default_store()
        if store is not None:
            store.add(f"{_ROOT}alive/{dist.get_rank()}", 1)


def _last_peers() -> list[ProcessId]:
    """Every rank's process at the last opening on the default group (kept in its state, see [Note: state per
    process group]): for a full-state gather that fails before its save opens."""
    state = world_state()
    return state.processes if state is not None else []


# ---------------------------------------------------------------------------------------------- failures
@dataclass(frozen=True)
class Failure:
    """What failed: on which rank (``None``: unknown), the cause, and whether that rank's process is gone."""

    rank: int | None
    cause: str
    errno: int | None = None
    gone: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Failure:
        return cls(**json.loads(data))


class RoundFailed(Exception):
    """Raised inside a save when another rank's failure (or a rank's death) was seen; carries it."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


def failures_of(err: BaseException, rank: int) -> list[Failure]:
    """The failures an exception reports: DCP's exception one per failing rank, anything else one on ``rank``."""
    if isinstance(err, RoundFailed):
        return [err.failure]
    if isinstance(err, dcp.CheckpointException) and err.failures:
        out = []
        for r, (exc, _) in sorted(err.failures.items()):
            out.extend(failures_of(exc, r))
        return out
    if isinstance(err, CheckpointError):  # its own message says what failed; the HINT is the save's
        cause = getattr(err.__cause__, "errno", None)
        return [
            Failure(rank, str(err).split(" HINT:")[0].rstrip("."), cause if isinstance(cause, int) else None)
        ]
    code = getattr(err, "errno", None)
    return [Failure(rank, f"{type(err).__name__}: {err}", code if isinstance(code, int) else None)]


def _gone(rank: int, process: ProcessId, how: str) -> Failure:
    return Failure(rank, f"its {process.describe()} {how}", None, gone=True)


def gone_peers(peers: list[ProcessId], rank: int, settle_s: float = 1.0) -> list[Failure]:
    """The peers whose process is known to have exited; looks for ``settle_s`` (a process dying closes its
    connections a moment before it is reaped)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = [_gone(r, p, "has exited") for r, p in enumerate(peers) if r != rank and p.gone()]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _disk_full(failure: Failure) -> bool:
    return failure.errno in _DISK_FULL or "No space left on device" in failure.cause


def _where(location: Location | None) -> str:
    if location is None:
        return "the checkpoint's folder"
    return location.url if isinstance(location, Remote) else str(location.parent)


def _hint(failure: Failure, location: Location | None) -> str:
    if failure.gone:
        return (
            f"rank {failure.rank}'s process ended during the save (killed, out of memory, a crash): see that "
            "rank's log. The run cannot go on without it; resume from the previous checkpoint."
        )
    where = _where(location)
    if _disk_full(failure):
        return (
            f"the storage that holds {where} is full: free space there (keep fewer checkpoints, e.g. "
            "ModelCheckpoint(save_top_k=...)) or save elsewhere, then save again; the training state is unaffected."
        )
    if failure.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"every rank must be allowed to write to {where}; fix the permissions and save again."
    return (
        "fix the cause (disk space, permissions, a directory every rank sees, the storage's endpoint and "
        "credentials) and save again; the training state is unaffected."
    )


def failure_message(what: str, location: Location, failure: Failure, own: Failure | None, rank: int) -> str:
    """The one error every rank raises for a failed save: what, where, on which rank, the cause, a HINT."""
    who = "a rank" if failure.rank is None else f"rank {failure.rank}"
    text = f"{what} of {location} failed on {who}: {failure.cause}."
    if own is not None and own.rank == rank and failure.rank != rank:
        text += f" (Then on this rank, rank {rank}: {own.cause}.)"
    return (
        f"{text} That checkpoint was not written: a previous checkpoint at {location} is unchanged, and what this "
        f"save had written is removed. HINT: {_hint(failure, location)}"
    )


def gather_for_save(location: Location | None = None) -> contextlib.AbstractContextManager[None]:
    """Around a full-state gather for a save (collectives before the save opens): a collective that fails inside
    (a peer that died, say) is raised as a :class:`CheckpointError` naming the failing rank (the peer whose
    process exited, if one did), the path and the cause (see [Note: save outcomes through the store]). Other
    errors pass unchanged."""
    return _collective_failure("The full-state gather for the save", location)


@contextlib.contextmanager
def _collective_failure(what: str, location: Location | None) -> Iterator[None]:
    try:
        yield
    except Exception as err:
        if not _is_collective_error(err):
            raise
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        (own,) = failures_of(err, rank)
        last = _last_peers()
        peers = gone_peers(last, rank) if last else []
        failure = peers[0] if peers else own
        target = f" of {location}" if location is not None else ""
        who = "a rank" if failure.rank is None else f"rank {failure.rank}"
        extra = f" (on rank {rank}: {own.cause})" if failure is not own else ""
        raise CheckpointError(
            f"{what}{target} failed on {who}: {failure.cause}{extra}. Nothing was written; a previous checkpoint "
            f"is unchanged. HINT: {_hint(failure, location)}"
        ) from err


# ---------------------------------------------------------------------------------------------- one save
class SaveRound:
    """One save's exchange through the store (see [Note: save outcomes through the store]); every rank opens it.

    As a context manager: an error inside is posted for the other ranks, the cleanups run, and it is raised as
    the save's :class:`CheckpointError` (see :meth:`abort`); the round is closed on the way out.

    Args:
        what: the save, for messages (``"The sharded save"``).
        location: where it writes.
        check: a check of the arguments this rank makes before anything is written; what it raises travels
            with the opening, so every rank raises (this rank its own error unchanged). Default: none.
    """

    def __init__(self, what: str, location: Location, check: Callable[[], None] | None = None) -> None:
        self.what, self.location = what, location
        self.store = _default_store()
        self.rank = dist.get_rank() if self.store is not None else 0
        self.world = dist.get_world_size() if self.store is not None else 1
        self._cleanups: list[Callable[[], None]] = []
        self._steps: list[str] = []
        self._posted = False
        self._closed = False
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last heartbeat seen, when it changed)
        self._beats_read = 0.0
        self._own_payload: bytes | None = None  # without a process group
        self._heartbeat = _Heartbeat()
        self.id = uuid.uuid4().hex[:12]
        self.peers = [ProcessId.mine()]
        refused: Exception | None = None
        try:
            if check is not None:
                check()
        except Exception as err:
            refused = err
        if self.store is None:
            if refused is not None:
                raise refused
            return
        self._open(refused)

    def _open(self, refused: Exception | None) -> None:
        """The opening collective: every rank's process, rank 0's id for the save, and any rank's refusal."""
        assert self.store is not None
        self._heartbeat.start()
        opened: list[Any] = [None] * self.world
        message = None if refused is None else f"{type(refused).__name__}: {refused}"
        try:
            with _collective_failure(f"The start of {self.what[0].lower()}{self.what[1:]}", self.location):
                dist.all_gather_object(opened, (self.peers[0], self.id, message))  # a peer gone: named
        except BaseException:
            self._heartbeat.stop()
            raise
        self.peers = [process for process, _, _ in opened]
        self.id = opened[0][1]
        state = world_state()
        if state is not None:
            state.processes = self.peers
        refusals = [(r, text) for r, (_, _, text) in enumerate(opened) if text is not None]
        if refusals:  # nothing was written: every rank raises, this rank's own refusal unchanged
            self._closed = True
            self._heartbeat.stop()
            if refused is not None:
                raise refused
            rank, text = refusals[0]
            raise CheckpointError(f"{self.what} of {self.location} was refused on rank {rank}: {text}")

    # ------------------------------------------------------------------ keys
    def _key(self, *parts: object) -> str:
        return _ROOT + "/".join(map(str, (self.id, *parts)))

    # ------------------------------------------------------------------ steps
    def on_failure(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` on this rank if the save fails (before :meth:`committed`)."""
        self._cleanups.append(cleanup)

    def committed(self) -> None:
        """The checkpoint is in place: a failure from now on must not remove what it wrote."""
        self._cleanups.clear()

    def arrive(self, step: str, payload: bytes | None = None) -> None:
        """Count this rank in at ``step`` (with ``payload`` for rank 0); see :meth:`wait`."""
        self._steps.append(step)
        if self.store is None:
            self._own_payload = payload
            return
        with self._store_errors():
            if payload is not None:
                self.store.set(self._key("payload", step, self.rank), payload)
            self.store.add(self._key(step), 1)

    def wait(self, step: str, stop: threading.Event | None = None, timeout_s: float | None = None) -> None:
        """Wait until every rank has arrived at ``step``. Raises :class:`RoundFailed` as soon as any rank's
        failure is posted or a watched rank is gone, when ``stop`` is set (the run was abandoned), or after
        ``timeout_s`` seconds."""
        if self.store is None:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause, watch_at = 0.001, 0.0
        while True:
            with self._store_errors():
                if self.store.add(self._key("failed"), 0):
                    raise RoundFailed(self._first_failure())
                if self.store.add(self._key(step), 0) >= self.world:
                    return
            now = time.monotonic()
            if stop is not None and stop.is_set():
                self._raise(Failure(self.rank, "the run failed, so the save was abandoned"))
            if deadline is not None and now > deadline:
                self._raise(
                    Failure(
                        None, f"not every rank finished {step!r} within {timeout_s:.0f} s (they still run)"
                    )
                )
            if now >= watch_at:
                self._watch(now)
                watch_at = now + WATCH_S
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)

    def agree(self, step: str, stop: threading.Event | None = None) -> None:
        """:meth:`arrive` and :meth:`wait`: every rank goes on only if no rank failed so far."""
        self.arrive(step)
        self.wait(step, stop)

    def payloads(self, step: str) -> list[bytes]:
        """Rank 0, after :meth:`wait`: every rank's payload for ``step``, in rank order (then deleted)."""
        if self.store is None:
            return [] if self._own_payload is None else [self._own_payload]
        keys = [self._key("payload", step, r) for r in range(self.world)]
        with self._store_errors():
            values = [bytes(v) for v in self.store.multi_get(keys)]
            for key in keys:
                self.store.delete_key(key)
        return values

    # ------------------------------------------------------------------ failures
    def post(self, failure: Failure) -> None:
        """Tell every rank that the save failed (once per rank; a store that is gone is ignored)."""
        if self._posted or self.store is None:
            return
        self._posted = True
        with contextlib.suppress(Exception):
            n = self.store.add(self._key("failed"), 1)
            self.store.set(self._key("error", n), failure.to_bytes())

    def _raise(self, failure: Failure) -> None:
        self.post(failure)
        raise RoundFailed(failure)

    def _posted_failure(self) -> Failure | None:
        if self.store is None:
            return None
        with contextlib.suppress(Exception):
            if self.store.add(self._key("failed"), 0):
                return self._first_failure()
        return None

    def _first_failure(self) -> Failure:
        assert self.store is not None
        key = self._key("error", 1)
        deadline = time.monotonic() + 2.0  # the first poster sets it right after counting itself
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return Failure(None, "a rank failed, and its report is missing (it died meanwhile)")
            time.sleep(0.005)
        return Failure.from_bytes(self.store.get(key))

    def _watch(self, now: float) -> None:
        """Rank 0 watches every rank, the others rank 0: raise if one is gone."""
        assert self.store is not None
        watched = list(range(1, self.world)) if self.rank == 0 else [0]
        for r in watched:
            if self.peers[r].gone():
                self._raise(_gone(r, self.peers[r], "has exited"))
        if now - self._beats_read < HEARTBEAT_S:
            return
        self._beats_read = now
        keys = [f"{_ROOT}alive/{r}" for r in watched]
        with self._store_errors():
            if self.store.check(keys):
                beats = [int(v) for v in self.store.multi_get(keys)]
            else:  # a heartbeat that never reached the store: count from now
                beats = [int(self.store.add(k, 0)) for k in keys]
        for r, beat in zip(watched, beats):
            last = self._beats.get(r)
            if last is None or last[0] != beat:
                self._beats[r] = (beat, now)
            elif now - last[1] > SILENCE_S:
                self._raise(_gone(r, self.peers[r], f"has not been heard from for {now - last[1]:.0f} s"))

    @contextlib.contextmanager
    def _store_errors(self) -> Iterator[None]:
        try:
            yield
        except RoundFailed:
            raise
        except Exception as err:  # the store's host process died (rank 0's, usually)
            gone = gone_peers(self.peers, self.rank, settle_s=0.5)
            raise RoundFailed(
                gone[0]
                if gone
                else Failure(0, f"the c10d store does not answer ({type(err).__name__}: {err})", gone=True)
            ) from err

    def fail(self, err: BaseException) -> CheckpointError:
        """This save failed on this rank with ``err``: post it for the others (unless it is theirs), run the
        cleanups, and return the error to raise. A collective that failed because a peer died is that peer's
        failure; a failure posted first elsewhere is the cause (this rank's error may be its consequence)."""
        own = failures_of(err, self.rank)
        failure = own[0]
        if not isinstance(err, RoundFailed):
            posted = self._posted_failure()
            if posted is not None:
                failure = posted
            else:
                settle = 1.0 if self.world > 1 and _is_collective_error(err) else 0.0
                gone = gone_peers(self.peers, self.rank, settle)
                failure = gone[0] if gone else failure
        self.post(failure)
        for cleanup in self._cleanups:
            with contextlib.suppress(Exception):
                cleanup()
        self._cleanups.clear()
        mine = next((f for f in own if f.rank == self.rank), None)
        return CheckpointError(failure_message(self.what, self.location, failure, mine, self.rank))

    def close(self) -> None:
        """This rank is done with the save. Waits (up to ``ACK_S``) until every rank that still runs is done with
        it too: the store's host may exit right after, and after a failure no rank goes on before rank 0 has
        removed what the save wrote. The last rank to leave deletes the save's keys."""
        if self._closed or self.store is None:
            return
        self._closed = True
        store = self.store
        try:
            store.add(self._key("out"), 1)
            deadline = time.monotonic() + ACK_S
            while time.monotonic() < deadline:
                gone = sum(p.gone() for r, p in enumerate(self.peers) if r != self.rank)
                if store.add(self._key("out"), 0) + gone >= self.world:
                    break
                time.sleep(0.005)
            if store.add(self._key("left"), 1) == self.world:
                failed = store.add(self._key("failed"), 0)
                steps = dict.fromkeys(self._steps)
                keys = [self._key(s) for s in steps]
                keys += [self._key("error", n) for n in range(1, failed + 1)]
                keys += [self._key("payload", s, r) for s in steps for r in range(self.world)]
                for key in [*keys, self._key("failed"), self._key("out"), self._key("left")]:
                    store.delete_key(key)
        except Exception:
            pass  # a store that is gone: nobody is left to tell
        finally:
            self._heartbeat.stop()

    def __enter__(self) -> SaveRound:
        return self

    def abort(self, err: BaseException) -> NoReturn:
        """The save failed on this rank with ``err``: :meth:`fail`, :meth:`close`, and raise the save's error
        (``err`` itself for an interrupt, or for flatshard's own refusal of an argument on the rank that raised it)."""
        try:
            failure = self.fail(err)
        finally:
            self.close()
        if isinstance(err, (Exception, dcp.CheckpointException)) and not _is_refusal(err):
            raise failure from err
        raise err

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if err is None:
            self.close()
            return
        self.abort(err)


def _is_refusal(err: BaseException) -> bool:
    """flatshard's own refusal of an argument (a ``ValueError``/``TypeError`` raised, not a wrapped failure, or an
    ``OSError`` without an errno, as ``IsADirectoryError("...")``): the rank that raised it keeps its type."""
    if isinstance(err, (ValueError, TypeError)):
        return err.__cause__ is None
    return isinstance(err, OSError) and err.errno is None


_TRANSPORT_ERRORS = ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL", "timed out")


def _is_collective_error(err: BaseException) -> bool:
    """An error of the process group's transport (a peer that closed its connection, say)."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in _TRANSPORT_ERRORS)
    )
