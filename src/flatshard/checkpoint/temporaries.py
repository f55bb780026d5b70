"""Hidden temporaries of local saves: who owns them, and the removal of those that dead runs left behind.

[Note: stale temporaries]
A local save writes into a hidden sibling of its target and renames it into place once complete: a directory
``.NAME.flatshard-tmp`` for a sharded save (see [Note: sharded checkpoint layout]), a file
``.NAME.HOST-PID.XXXXXXXX.tmp`` for a full one. A save that fails or is abandoned removes its own (see
[Note: save outcomes through the store]). A run that was killed cannot, and the next save may have another name
(``ModelCheckpoint``'s names carry the step), so every local save (rank 0) first looks through its folder and
removes the hidden temporaries of other names whose owner is gone:

- A sharded save's directory holds ``.flatshard-owner``: the process that created it (rank 0 of its run), as a
  :class:`~flatshard.checkpoint.processes.ProcessId`. It is stale once that process is gone: it ran on this
  machine (host, boot and pid namespace) and no process with its pid and start time runs any more.
- A full save's temporary file names its host and pid: stale when that host is this one and no process with
  that pid runs.
- Where nothing can be told (another machine; no owner marker: an older flatshard, or a process killed
  between creating the directory and writing the marker), a temporary is stale once nothing in it has changed
  for ``STALE_AFTER_S`` (a day): a save in progress keeps writing.

So a save in progress by a live run is never removed: on this machine its process runs, elsewhere it writes.
The hidden directory of the save's own name is replaced unless a live process of this machine owns it (two
runs saving to one path: refused). The owner marker is removed just before the directory is renamed into
place, so a checkpoint holds no trace of it. ``.NAME.flatshard-old`` (a previous checkpoint moved aside for
the rename) is never swept: after a crash at that moment it is the only copy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
from pathlib import Path

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.processes import ProcessId

__all__ = [
    "OWNER",
    "STALE_AFTER_S",
    "create_hidden_directory",
    "hidden_directory",
    "read_owner",
    "remove",
    "sweep",
    "temp_file_prefix",
    "write_owner",
]

OWNER = ".flatshard-owner"
STALE_AFTER_S = 24 * 3600.0
_HIDDEN_DIR = re.compile(r"^\..+\.flatshard-tmp$")
_TEMP_FILE = re.compile(r"^\..+-(?P<pid>\d+)\.(?P<random>[a-z0-9_]+)\.tmp$")  # mkstemp: 8 random characters


def hidden_directory(target: Path) -> Path:
    """The hidden sibling a local sharded save of ``target`` writes into."""
    return target.parent / f".{target.name}.flatshard-tmp"


def temp_file_prefix(target: Path) -> str:
    """The start of the name of a full save's temporary file for ``target`` (``mkstemp`` adds the rest)."""
    return f".{target.name}.{socket.gethostname()}-{os.getpid()}."


def write_owner(directory: Path, owner: ProcessId | None = None) -> None:
    (directory / OWNER).write_text((owner or ProcessId.mine()).to_json())


def read_owner(directory: Path) -> ProcessId | None:
    try:
        return ProcessId.from_json((directory / OWNER).read_bytes())
    except OSError:
        return None


def remove(path: Path) -> None:
    """Delete a temporary file or directory; what cannot be removed stays (the next save retries)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _idle_for(path: Path) -> float:
    """Seconds since anything in ``path`` (a file, or a directory and the files in it) last changed."""
    try:
        times = [path.stat().st_mtime]
        if path.is_dir():
            times += [entry.stat().st_mtime for entry in os.scandir(path)]
    except OSError:
        return 0.0
    return time.time() - max(times)


def _owner_gone(entry: Path) -> bool:
    """Whether the save that left ``entry`` is dead (see [Note: stale temporaries])."""
    if _HIDDEN_DIR.match(entry.name) and entry.is_dir():
        owner = read_owner(entry)
        if owner is not None and owner.on_this_machine():
            return owner.gone()
    else:
        found = _TEMP_FILE.match(entry.name)
        if found is None or not entry.is_file():
            return False  # not one of ours
        if f".{socket.gethostname()}-{found['pid']}." in entry.name:
            process = ProcessId.of(int(found["pid"]))
            return process is None or process.gone()
        if len(found["random"]) != 8:
            return False  # judged by age only if it is surely a temporary file of ours
    return _idle_for(entry) > STALE_AFTER_S


def sweep(folder: Path, keep: Path | None = None) -> list[Path]:
    """Remove the hidden temporaries in ``folder`` that dead runs left (other than ``keep``); returns them."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(".")]
    except OSError:
        return []
    removed = []
    for name in names:
        entry = folder / name
        if entry != keep and _owner_gone(entry):
            remove(entry)
            removed.append(entry)
    return removed


def create_hidden_directory(target: Path) -> Path:
    """Rank 0: sweep ``target``'s folder, then create the empty hidden directory a sharded save of ``target``
    writes into, with this process as its owner. One of that name left by an earlier save is removed, unless a
    live process of this machine owns it."""
    tmp = hidden_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target.parent, keep=tmp)
    if tmp.exists() or tmp.is_symlink():
        owner = read_owner(tmp)
        if owner is not None and owner.on_this_machine() and not owner.gone() and owner != ProcessId.mine():
            raise CheckpointError(
                f"Cannot save {target}: {owner.describe()} is saving to the same path ({tmp} is its save in "
                "progress). HINT: give each run its own checkpoint directory."
            )
        remove(tmp)
    tmp.mkdir()
    write_owner(tmp)
    return tmp
