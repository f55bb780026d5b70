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
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from flatshard.checkpoint import temporaries
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.save_round import SaveRound
from flatshard.checkpoint.storage import (
    Remote,
    incomplete_error,
    locate,
    locate_checked,
    remote_kind,
    storage_error,
)
from flatshard.engine import ParamShard, global_rank

__all__ = [
    "CheckpointError",
    "RecordingFile",
    "atomic_save",
    "atomic_write",
    "fsync_dir",
    "load_checkpoint_file",
    "recording",
    "refuse_directory",
    "refuse_pieces",
    "write_full_checkpoint",
    "write_offline",
]

_READ_ERRORS = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError)


def write_full_checkpoint(checkpoint: Any, path: str | os.PathLike[str] | Remote) -> Path | str:
    """Every rank calls; rank 0 writes ``checkpoint`` to ``path`` (a file or a URL) with :func:`atomic_save`.

    A URL's storage is checked on every rank first (see [Note: checkpoint storage]); if the write fails on
    rank 0, every rank raises its error within seconds instead of waiting for it (see
    [Note: save outcomes through the store]). Returns the path (the URL for a URL).
    """
    refuse_pieces(checkpoint)
    location = locate_checked(path)
    check = (lambda: refuse_directory(location)) if global_rank() == 0 else None
    with SaveRound("The full save", location, check) as round_:
        if global_rank() == 0:
            atomic_save(checkpoint, location)
        round_.agree("written")
    return location if isinstance(location, Path) else location.url


def refuse_pieces(checkpoint: Any, path: tuple[Any, ...] = ()) -> None:
    """A full file holds whole tensors: a rank's piece (``EMA.sharded_state_dict()``...) has no place in it."""
    if isinstance(checkpoint, ParamShard):
        where = "".join(f"[{k!r}]" for k in path)
        raise ValueError(
            f"checkpoint{where} is one rank's piece of a sharded tensor, which a full checkpoint cannot hold. HINT: "
            "save it with state_dict_type='sharded', or put the consolidated state in (for an EMA, "
            "ema.full_state_dict() on every rank)."
        )
    if isinstance(checkpoint, Mapping):
        for k, v in checkpoint.items():
            refuse_pieces(v, (*path, k))
    elif isinstance(checkpoint, (list, tuple)):
        for i, v in enumerate(checkpoint):
            refuse_pieces(v, (*path, i))


def atomic_save(obj: Any, path: str | os.PathLike[str] | Remote) -> Path | str:
    """``torch.save`` to ``path`` via a temporary file, fsync and rename; at a URL in one committed upload.

    See :func:`atomic_write`. Returns the path (the URL for a URL).
    """
    return atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike[str] | Remote, write: Callable[[IO[bytes]], None]) -> Path | str:
    """Write ``path`` with ``write(file)``: locally via a temporary file, fsync and rename, so a crash leaves any
    old file intact; at a URL in an fsspec transaction, so the object appears whole or not at all.

    The file gets the permissions ``open()`` would give it (those of the file it replaces, else
    ``0o666`` less the umask). Hidden temporaries that dead runs left in the folder are removed first (see
    [Note: stale temporaries]); a failed write removes its own. A :class:`CheckpointError` raised by ``write``
    passes unchanged; other errors at a URL are reported naming it. Returns the path (the URL for a URL).
    """
    target = locate(path)
    refuse_directory(target)
    if isinstance(target, Remote):
        return _write_remote(target, write)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporaries.sweep(target.parent)
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
    fd, tmp_name = tempfile.mkstemp(
        prefix=temporaries.temp_file_prefix(target), suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), mode)
            with recording(f) as recorded:
                write(recorded)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    fsync_dir(target.parent)
    return target


def write_offline(path: str | os.PathLike[str] | Remote, write: Callable[[IO[bytes]], None]) -> Path | str:
    """:func:`atomic_write` for one process's tools (``consolidate``, exports): a local write that fails (a full
    disk, no permission) raises :class:`CheckpointError` naming the file and saying it is unchanged."""
    try:
        return atomic_write(path, write)
    except OSError as err:
        target = locate(path)
        raise CheckpointError(
            f"Could not write {target}: {err.strerror or err}. {target} is as it was before (nothing was renamed "
            "over it, no temporary is left). HINT: free space in that folder, or write somewhere else."
        ) from err


class RecordingFile:
    """A file whose writes keep the first ``OSError`` they raised: ``torch.save`` reports one (a full disk, a
    dropped connection) only as "unexpected pos", so :func:`recording` raises the recorded one instead."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._f.write(data))
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def recording(f: Any) -> Iterator[Any]:
    """``f`` as a :class:`RecordingFile`; an error inside that stands for a write's ``OSError`` is raised as it."""
    recorded = RecordingFile(f)
    try:
        yield recorded
    except Exception as err:
        if recorded.error is not None and not isinstance(err, (OSError, CheckpointError)):
            raise recorded.error from err
        raise


def refuse_directory(target: Path | Remote) -> None:
    hint = (
        "HINT: save to another path, or remove it first (flatshard.checkpoint.remove_checkpoint); nothing was "
        "written."
    )
    if isinstance(target, Remote):
        if remote_kind(target) in ("sharded", "incomplete"):
            raise IsADirectoryError(
                f"Cannot write the checkpoint {target.url}: a directory (sharded checkpoint) of that name exists. "
                + hint
            )
    elif target.is_dir():
        raise IsADirectoryError(
            f"Cannot write the checkpoint {target}: a directory of that name exists. {hint}"
        )


def _write_remote(target: Remote, write: Callable[[IO[bytes]], None]) -> str:
    try:
        with target.fs.transaction, target.fs.open(target.path, "wb") as f, recording(f) as recorded:
            write(recorded)  # committed on success only
    except CheckpointError:
        raise
    except Exception as err:
        raise storage_error(target, err, "write it") from err
    finally:
        target.refresh()
    return target.url


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
