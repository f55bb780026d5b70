"""Hidden temporaries of local saves: who owns them, and the removal of those that dead runs left behind.

[Note: stale temporaries]
A local save writes into a hidden sibling of its target and renames it into place once complete: a directory
``.NAME.flatshard-tmp`` for a sharded save (see [Note: sharded checkpoint layout]), a file
``.NAME.HOST-PID.XXXXXXXX.tmp`` for a full one. A save that fails or is abandoned removes its own (see
[Note: save outcomes through the store]). A run that was killed cannot, and the next save may have another name
(``ModelCheckpoint``'s names carry the step), so every local save (rank 0) first looks through its folder and
removes the hidden temporaries of other names whose owner is gone:

- A sharded save's directory holds ``.flatshard-owner``: the process that created it (rank 0 of its run), as a
  :class:`~flatshard.engine.transport.processes.ProcessId`. It is stale once that process is gone: it ran on this
  machine (host, boot and pid namespace) and no process with its pid and start time runs any more.
- A full save's temporary file names its host and pid: stale when that host is this one and no process with
  that pid runs.
- Where nothing can be told (another machine; no owner marker: an older flatshard, or a process killed
  between creating the directory and writing the marker), a temporary is stale once nothing in it has changed
  for ``STALE_AFTER_S`` (a day): a save in progress keeps writing.

At a URL there is no hidden sibling: a sharded save writes its data objects (``__<rank>_<save id>_0.distcp``)
under the target's own prefix and ``.metadata`` last (see [Note: checkpoint storage]). Rank 0 first writes the
owner object ``.flatshard-owner-<save id>`` there and removes it just before ``.metadata``; a failed save
removes its objects, owner included. A killed run leaves its data objects and owner object, so every sharded
save to a URL (rank 0) first looks through the prefixes beside its target (one listing of the parent, two
levels deep) and removes, per save id, the objects of saves whose owner is gone by the same rules: its owner
ran on this machine and runs no more, or nothing of that save changed for ``STALE_AFTER_S``. A prefix with
flatshard data objects only, no ``.metadata`` and no owner object (killed before it wrote one) goes once idle
for ``STALE_AFTER_S``. Other objects (not flatshard's) are never touched, and neither is anything a
``.metadata`` may reference: the owner object is gone before the metadata exists.

So a save in progress by a live run is never removed: on this machine its process runs, elsewhere it writes.
The hidden directory of the save's own name is replaced unless a live process of this machine owns it (two
runs saving to one path: refused). The owner marker is removed just before the directory is renamed into
place, so a checkpoint holds no trace of it. ``.NAME.flatshard-old`` (a previous checkpoint moved aside for
the rename) is never swept: after a crash at that moment it is the only copy.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.storage import METADATA, REMOTE_OWNER, Remote
from flatshard.engine import ProcessId

__all__ = [
    "OWNER",
    "STALE_AFTER_S",
    "claim_remote",
    "create_hidden_directory",
    "hidden_directory",
    "read_owner",
    "remove",
    "sweep",
    "sweep_remote",
    "temp_file_prefix",
    "write_owner",
]

log = logging.getLogger(__name__)

OWNER = ".flatshard-owner"
STALE_AFTER_S = 24 * 3600.0
_HIDDEN_DIR = re.compile(r"^\..+\.flatshard-tmp$")
_TEMP_FILE = re.compile(r"^\..+-(?P<pid>\d+)\.(?P<random>[a-z0-9_]+)\.tmp$")  # mkstemp: 8 random characters
_DATA_OBJECT = re.compile(r"^__\d+_(?P<save>[0-9a-zA-Z]+)_\d+\.distcp$")  # a URL save's data object


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


# ---------------------------------------------------------------------------------------------- at URLs
def claim_remote(target: Remote, save_id: str) -> None:
    """Rank 0, before any data object of a sharded save to ``target`` exists: remove what dead saves left beside
    it, then write this save's owner object (see [Note: stale temporaries])."""
    sweep_remote(target)
    target.fs.makedirs(target.path, exist_ok=True)
    target.fs.pipe_file(target.child(REMOTE_OWNER + save_id).path, ProcessId.mine().to_json().encode())


def _modified(entry: dict[str, Any]) -> float | None:
    """An object's last change (seconds since the epoch) from its fsspec info, or ``None`` if it says none."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = entry.get(key)
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return _modified({key: datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))})
    return None


def _idle(entries: list[dict[str, Any]]) -> bool:
    """Whether nothing of ``entries`` changed for ``STALE_AFTER_S`` (unknown times: not idle)."""
    times = [_modified(e) for e in entries]
    if not times or any(t is None for t in times):
        return False
    return time.time() - max(t for t in times if t is not None) > STALE_AFTER_S


def _remote_owner(target: Remote, entry: dict[str, Any]) -> ProcessId | None:
    try:
        return ProcessId.from_json(target.fs.cat_file(str(entry["name"])))
    except Exception:  # unreadable: judged by age
        return None


def _dead_objects(prefix: Remote, objects: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects under one prefix that dead saves left (see [Note: stale temporaries])."""
    saves: dict[str, list[dict[str, Any]]] = {}
    for name, entry in objects.items():
        found = _DATA_OBJECT.match(name)
        if found is not None:
            saves.setdefault(found["save"], []).append(entry)
    dead: list[dict[str, Any]] = []
    owned: set[str] = set()
    for name, entry in objects.items():
        if not name.startswith(REMOTE_OWNER):
            continue
        save_id = name.removeprefix(REMOTE_OWNER)
        owned.add(save_id)
        owner = _remote_owner(prefix, entry)
        of_save = [entry, *saves.get(save_id, [])]
        if owner is not None and owner.on_this_machine() and owner.gone():
            dead += of_save
        elif (owner is None or not owner.on_this_machine()) and _idle(of_save):
            dead += of_save
    unowned = [e for save_id, entries in saves.items() if save_id not in owned for e in entries]
    only_data = all(_DATA_OBJECT.match(n) or n.startswith(REMOTE_OWNER) for n in objects)
    if METADATA not in objects and only_data and unowned and _idle(unowned):
        dead += unowned  # killed before it wrote its owner object, or written by an older flatshard
    return dead


def sweep_remote(target: Remote) -> list[str]:
    """Rank 0 of a sharded save to ``target``: remove the objects of dead saves under the prefixes beside it
    (``target`` itself is its own save's to replace); returns their URLs. Never raises: what cannot be listed
    or removed stays for the next save."""
    parent_url, _, name = target.url.rpartition("/")
    parent_path = target.path.rstrip("/").rpartition("/")[0]
    if not parent_path:
        return []
    removed: list[str] = []
    try:
        target.fs.invalidate_cache(parent_path)
        found = target.fs.find(parent_path, maxdepth=2, withdirs=False, detail=True)
        base = parent_path.strip("/")
        prefixes: dict[str, dict[str, dict[str, Any]]] = {}
        for full, entry in found.items():
            parts = str(full).strip("/")[len(base) :].strip("/").split("/")
            if len(parts) == 2 and parts[0] != name:
                prefixes.setdefault(parts[0], {})[parts[1]] = entry
        for child, objects in prefixes.items():
            prefix = Remote(f"{parent_url}/{child}", target.fs, f"{parent_path}/{child}")
            dead = _dead_objects(prefix, objects)
            for entry in dead:
                target.fs.rm_file(str(entry["name"]))
                removed.append(f"{prefix.url}/{str(entry['name']).rstrip('/').rsplit('/', 1)[-1]}")
            if dead and len(dead) == len(objects):
                with contextlib.suppress(Exception):  # a filesystem with folders: the one it left empty
                    if target.fs.isdir(prefix.path) and not target.fs.ls(prefix.path):
                        target.fs.rmdir(prefix.path)
    except Exception as err:  # listing or removing failed: the save goes on
        log.warning("flatshard: could not remove what dead saves left beside %s (%s).", target.url, err)
    finally:
        target.fs.invalidate_cache(parent_path)
    return removed
