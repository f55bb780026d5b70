"""Checkpoint files: atomic writes and validated reads with errors that name the file.

A full checkpoint is a plain ``torch.save`` file (a plain Lightning checkpoint), so it loads without
flatshard installed. Local writes go to a temporary name beside the target, are flushed and fsynced, then
renamed over it: a crash mid-save leaves the previous checkpoint intact. At a URL the file is streamed in
an fsspec transaction and appears whole or not at all (see [Note: checkpoint storage]).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.storage import (
    Remote,
    incomplete_error,
    locate,
    locate_checked,
    remote_kind,
    storage_error,
)
from flatshard.checkpoint.validate import agree_on_error
from flatshard.engine import ParamShard, global_rank

__all__ = [
    "CheckpointError",
    "atomic_save",
    "atomic_write",
    "fsync_dir",
    "load_checkpoint_file",
    "write_full_checkpoint",
]

_READ_ERRORS = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError)


def write_full_checkpoint(checkpoint: Any, path: str | os.PathLike[str] | Remote) -> Path | str:
    """Every rank calls; rank 0 writes ``checkpoint`` to ``path`` (a file or a URL) with :func:`atomic_save`.

    A URL's storage is checked on every rank first (see [Note: checkpoint storage]); if the write fails on
    rank 0, every rank raises instead of the others waiting for it. Returns the path (the URL for a URL).
    """
    _refuse_pieces(checkpoint)
    location = locate_checked(path)
    error: BaseException | None = None
    if global_rank() == 0:
        try:
            atomic_save(checkpoint, location)
        except Exception as err:
            error = err
    agree_on_error(error, "Saving the checkpoint")
    return location if isinstance(location, Path) else location.url


def _refuse_pieces(checkpoint: Any, path: tuple[Any, ...] = ()) -> None:
    """A full file holds whole tensors: a rank's piece (``ShardedEMA.sharded_state_dict()``...) has no place in it."""
    if isinstance(checkpoint, ParamShard):
        where = "".join(f"[{k!r}]" for k in path)
        raise ValueError(
            f"checkpoint{where} is one rank's piece of a sharded tensor, which a full checkpoint cannot hold. HINT: "
            "save it with state_dict_type='sharded', or put the consolidated state in (for an EMA, "
            "ema.full_state_dict() on every rank)."
        )
    if isinstance(checkpoint, Mapping):
        for k, v in checkpoint.items():
            _refuse_pieces(v, (*path, k))
    elif isinstance(checkpoint, (list, tuple)):
        for i, v in enumerate(checkpoint):
            _refuse_pieces(v, (*path, i))


def atomic_save(obj: Any, path: str | os.PathLike[str] | Remote) -> Path | str:
    """``torch.save`` to ``path`` via a temporary file, fsync and rename; at a URL in one committed upload.

    See :func:`atomic_write`. Returns the path (the URL for a URL).
    """
    return atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike[str] | Remote, write: Callable[[IO[bytes]], None]) -> Path | str:
    """Write ``path`` with ``write(file)``: locally via a temporary file, fsync and rename, so a crash leaves any
    old file intact; at a URL in an fsspec transaction, so the object appears whole or not at all.

    The file gets the permissions ``open()`` would give it (those of the file it replaces, else
    ``0o666`` less the umask), and temporary files left by an earlier save of the same name on this host
    whose process is gone are removed. A :class:`CheckpointError` raised by ``write`` passes unchanged; other
    errors at a URL are reported naming it. Returns the path (the URL for a URL).
    """
    target = locate(path)
    if isinstance(target, Remote):
        return _write_remote(target, write)
    if target.is_dir():
        raise IsADirectoryError(f"Cannot write the checkpoint {target}: a directory of that name exists.")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
    fd, tmp_name = tempfile.mkstemp(
        prefix=f"{_temp_prefix(target)}{os.getpid()}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    fsync_dir(target.parent)
    return target


def _write_remote(target: Remote, write: Callable[[IO[bytes]], None]) -> str:
    if remote_kind(target) in ("sharded", "incomplete"):
        raise IsADirectoryError(
            f"Cannot write the checkpoint {target.url}: a directory (sharded checkpoint) of that name exists."
        )
    try:
        with target.fs.transaction, target.fs.open(target.path, "wb") as f:  # committed on success only
            write(f)
    except CheckpointError:
        raise
    except Exception as err:
        raise storage_error(target, err, "write it") from err
    finally:
        target.refresh()
    return target.url


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{socket.gethostname()}-"


def _remove_stale_temporaries(target: Path) -> None:
    """Delete ``.NAME.HOST-PID.*.tmp`` files of this host whose process no longer runs (a killed save)."""
    prefix = _temp_prefix(target)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix) :].split(".", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(target.parent / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)  # no /proc: read it by setting it (and restore at once)
    os.umask(current)
    return current


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def load_checkpoint_file(
    path: str | os.PathLike[str] | Remote, weights_only: bool | None = None
) -> dict[str, Any]:
    """Read a full checkpoint: memory-mapped if local (tensors are paged in only when sliced), streamed from
    its storage at a URL."""
    target = locate(path)
    if isinstance(target, Remote):
        return _checked(target, _load_remote(target, weights_only))
    if not target.exists():
        raise FileNotFoundError(
            f"Checkpoint {target} does not exist. HINT: check the path passed as ckpt_path."
        )
    if target.is_dir() and not (target / ".metadata").is_file():
        raise CheckpointError(
            f"Checkpoint {target} is a directory without a .metadata file: not a sharded checkpoint, or one whose "
            f"save did not finish (it holds {sorted(p.name for p in target.iterdir())[:5]}). HINT: use an earlier "
            "checkpoint; nothing was loaded."
        )
    if target.is_dir():
        raise CheckpointError(
            f"Checkpoint {target} is a directory (a sharded checkpoint), not a file. HINT: load it with "
            "flatshard.load_checkpoint or a flatshard strategy, or turn it into one file with "
            f"`flatshard consolidate {target} OUT.ckpt`."
        )
    if target.stat().st_size == 0:
        raise CheckpointError(
            f"Checkpoint {target} is empty (0 bytes): the save was interrupted. Use an earlier one."
        )
    try:
        checkpoint = torch.load(
            target,
            map_location="cpu",
            mmap=True,
            weights_only=bool(weights_only) if weights_only is not None else False,
        )
    except _READ_ERRORS as err:
        raise _unreadable(target, err) from err
    return _checked(target, checkpoint)


def _load_remote(target: Remote, weights_only: bool | None) -> Any:
    kind = remote_kind(target)
    if kind == "missing":
        raise FileNotFoundError(
            f"Checkpoint {target.url} does not exist. HINT: check the URL passed as ckpt_path (and that the "
            "endpoint and credentials point at the storage that holds it)."
        )
    if kind == "incomplete":
        raise incomplete_error(target)
    if kind == "sharded":
        raise CheckpointError(
            f"Checkpoint {target.url} is a directory (a sharded checkpoint), not a file. HINT: load it with "
            "flatshard.load_checkpoint or a flatshard strategy, or turn it into one file with "
            f"`flatshard consolidate {target.url} OUT.ckpt`."
        )
    try:
        if not target.fs.size(target.path):
            raise CheckpointError(
                f"Checkpoint {target.url} is empty (0 bytes): the save was interrupted. Use an earlier one."
            )
        with target.fs.open(target.path, "rb") as f:
            return torch.load(
                f, map_location="cpu", weights_only=bool(weights_only) if weights_only is not None else False
            )
    except CheckpointError:
        raise
    except _READ_ERRORS as err:
        raise _unreadable(target, err) from err
    except Exception as err:
        raise storage_error(target, err, "read it") from err


def _unreadable(target: Path | Remote, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {target} could not be read ({type(err).__name__}: {err}). It is truncated or not a torch "
        "checkpoint. HINT: use an earlier checkpoint; nothing was loaded."
    )


def _checked(target: Path | Remote, checkpoint: Any) -> dict[str, Any]:
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"Checkpoint {target} holds a {type(checkpoint).__name__}, not a checkpoint dict."
        )
    return checkpoint
