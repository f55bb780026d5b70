"""What the engine keeps per process group, found through the group and released with it.

[Note: state per process group]
Some of the engine's state belongs to a process group rather than to one ``shard()`` root: several roots may
share a group, and what they issue on it is numbered, ordered and moved together. One :class:`GroupState` per
group holds it:

- its name and ranks, and how many flat collectives this rank issued on it (the labels of [Note: finding a
  desync]), with the signatures of the last few (the evidence a desync verdict compares), and the bytes this
  rank sent into them per kind (``sent``: what crosses which group, e.g. between nodes under hybrid sharding);
- its desync limit, set by the last ``shard()`` on it;
- its shared-memory channel, agreed on once by its ranks (see [Note: shared-memory collectives]);
- whether its backend refused ``reduce_scatter`` (the all-reduce fallback, warned about once per group);
- on the default group only: the hybrid shard and replicate groups made from a size (see [Note: hybrid
  groups]), the desync monitor (the heartbeat thread and the main thread's wait: both about the default
  group's store) and every rank's process as last exchanged for a save.

The state is found through the group object in one weak-keyed map (torch's ``ProcessGroup`` takes weak
references but no attributes), and it never references the group strongly, so the entry dies with the group.
Dying, it closes what it holds: the channel's worker thread stops and its segments are unmapped, the heartbeat
stops. A group that torch has destroyed but that something still references (a model not yet collected) is
*stale*: :func:`live` closes and forgets it the next time anyone looks, so a group made later under the same
name (a new default group after an estimate's fake one) starts afresh: its own limit, numbering and channel.
A root reaches the state of its groups through them; nothing here is keyed by ``id()`` or by a name.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from typing import Any

import torch.distributed as dist

__all__ = ["GroupState", "live", "state_of", "world_state"]

ProcessGroup = Any  # torch.distributed.ProcessGroup


class GroupState:
    """The engine's state of one process group (see [Note: state per process group])."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.name = _name(pg)  # the same on every rank; "" where torch does not say
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(pg))  # global ranks
        self.flat_seq = 0  # flat collectives this rank issued on the group
        # bytes this rank sent into the group's flat collectives, per kind
        self.sent: Counter[str] = Counter()
        self.issued: deque[list[Any]] | None = None  # the last ones' signatures (the watchdog's)
        self.desync_limit: float | None = None  # None: never reported (when limit_set)
        self.limit_set = False  # a shard() set desync_limit; otherwise the process-wide limit applies
        # the shm.ShmGroup of the group once agreed (None: the backend); typed loosely, as below: the modules that
        # fill these slots import this one
        self.channel: Any | None = None
        self.channel_agreed = False
        self.native_reduce_scatter = True  # False once the backend refused reduce_scatter
        # the default group only
        self.hybrid: dict[
            int, tuple[list[ProcessGroup], list[ProcessGroup]]
        ] = {}  # shard group size -> groups
        # reshard_after_forward=k: (k, the shard group's global ranks) -> this rank's group of k of them
        self.node_local: dict[tuple[int, tuple[int, ...]], ProcessGroup] = {}
        self.monitor: Any | None = None  # the watchdog.Monitor (desync detector) of this process
        self.processes: list[Any] = []  # every rank's processes.ProcessId at the last save's opening
        self._group = weakref.ref(pg)
        self.closed = False

    @property
    def group(self) -> ProcessGroup | None:
        """The process group, while it lives."""
        return self._group()

    def registered(self) -> bool:
        """Whether torch still knows the group (it was not destroyed)."""
        pg = self._group()
        if pg is None or not dist.is_initialized():
            return False
        try:
            dist.get_process_group_ranks(pg)
        except (KeyError, RuntimeError, ValueError):
            return False
        return True

    def close(self) -> None:
        """Release what the state holds: the channel's thread and segments, the heartbeat, the subgroups."""
        if self.closed:
            return
        self.closed = True
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.stop()
        self.hybrid.clear()

    def __repr__(self) -> str:
        return f"GroupState(name={self.name!r}, ranks={list(self.ranks)}, flat_seq={self.flat_seq})"


# Every process group the engine has used -> its state. Module-level because a process group is the owner and
# torch gives it no attribute to hold it; keyed weakly by the group object, so an entry dies with its group.
_STATES: weakref.WeakKeyDictionary[ProcessGroup, GroupState] = weakref.WeakKeyDictionary()


def state_of(group: ProcessGroup | None) -> GroupState:
    """The state of ``group`` (``None``: the default group), made on first use. torch.distributed must be
    initialized."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(
            "flatshard: no process group: torch.distributed is not initialized. HINT: call "
            "torch.distributed.init_process_group() first."
        )
    state = _STATES.get(pg)
    if state is None or state.closed:
        state = _STATES[pg] = GroupState(pg)
        finalizer = weakref.finalize(pg, state.close)
        finalizer.atexit = False  # at exit the daemon threads end with the process
    return state


def world_state() -> GroupState | None:
    """The default group's state, or ``None`` without an initialized default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return state_of(None)


def live() -> list[tuple[ProcessGroup, GroupState]]:
    """Every group with a state that torch still knows, and its state; stale ones are closed and forgotten."""
    out = []
    for pg, state in list(_STATES.items()):
        if state.registered():
            out.append((pg, state))
        else:
            state.close()
            _STATES.pop(pg, None)
    return out


def _name(pg: ProcessGroup) -> str:
    try:
        return str(pg.group_name)
    except (AttributeError, RuntimeError):
        return ""
