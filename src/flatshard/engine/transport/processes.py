"""Which process this is, and whether another one still runs: positive evidence for the desync detector (a peer
that exited, see [Note: finding a desync]), the shared-memory transport (a peer gone mid-collective) and saves
that lost a rank or an owner (see [Note: save outcomes through the store] and [Note: stale temporaries]).

A process is named by its host name, the machine's boot id, its pid namespace, its pid and its start time (in
clock ticks since boot). Another process is known to be gone only when it ran on this machine, in this pid
namespace (so its pid means the same here), and no process with that pid and start time runs now (a zombie
counts as gone: it can no longer write). Anywhere else nothing can be told from here.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass

__all__ = ["ProcessId", "pid_gone"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time of process ``pid``, from ``/proc``; ``None`` if there is none."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": state, ppid, ...; starttime is field 22
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class ProcessId:
    """A process, named so that another process can tell whether it still runs."""

    host: str
    boot: str  # the machine's boot id: a reboot ends every process
    pidns: int  # the inode of its pid namespace (containers)
    pid: int
    start: int  # start time in clock ticks since boot: a reused pid has another

    @classmethod
    def mine(cls) -> ProcessId:
        found = cls.of(os.getpid())
        assert found is not None or not os.path.isdir("/proc")
        return found or cls(socket.gethostname(), "", 0, os.getpid(), 0)

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The running process ``pid`` of this machine, or ``None`` if there is none."""
        stat = _stat(pid)
        if stat is None:
            return None
        boot = _read("/proc/sys/kernel/random/boot_id")
        return cls(socket.gethostname(), boot, _pid_namespace(), pid, stat[1])

    def on_this_machine(self) -> bool:
        """Whether its pid means the same here: this host, this boot, this pid namespace (and ``/proc`` to look)."""
        return (
            bool(self.boot)
            and self.host == socket.gethostname()
            and self.boot == _read("/proc/sys/kernel/random/boot_id")
            and self.pidns == _pid_namespace()
        )

    def gone(self) -> bool:
        """Positive evidence that it no longer runs; ``False`` when it runs or when nothing can be told."""
        if not self.on_this_machine():
            return False
        stat = _stat(self.pid)
        return stat is None or stat[0] in ("Z", "X") or stat[1] != self.start

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ProcessId | None:
        """The process a marker names, or ``None`` for text that does not name one."""
        try:
            fields = json.loads(text)
            return cls(
                str(fields["host"]),
                str(fields["boot"]),
                int(fields["pidns"]),
                int(fields["pid"]),
                int(fields["start"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def pid_gone(pid: object) -> bool:
    """Whether no process ``pid`` runs on this machine, for a pid known to be of this machine and this pid
    namespace (a peer of the shared-memory transport, a name in ``/dev/shm``). Positive evidence only: a
    process of another user, or something that is not a pid, is not gone; a zombie is."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if os.path.isdir("/proc"):
        stat = _stat(pid)
        return stat is None or stat[0] in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # not ours to signal (it exists), or not a pid
        return False
    return False
