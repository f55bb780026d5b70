"""Where a checkpoint lives: a local path, or any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

[Note: checkpoint storage]
Whether a path is local or a URL is decided from its text alone, so every rank decides alike:
``scheme://...`` with a scheme other than ``file`` is a URL, handled only through its fsspec filesystem and
never through ``pathlib`` (which collapses ``//``: ``Path("s3://b/run")`` is the local ``s3:/b/run``).
``file://`` URLs and plain paths are local. A local path with a part ``<scheme>:`` for a scheme fsspec
knows (``s3:/b/run``, ``/work/file:/tmp/run``: a URL that went through ``Path`` or ``os.path``) is refused,
never written: the data would not be where it was asked for.

Local paths keep their atomic writes (temporary name, fsync, rename). Object stores have no rename and no
directories, so at a URL:

- a full file is streamed inside an fsspec transaction: the object appears whole when the upload is
  committed, or not at all (a failed upload is discarded);
- a sharded directory is complete once its ``.metadata`` object exists. The data objects are written first,
  under names unique to the save, the metadata last in one request, and only then are earlier saves' data
  objects deleted; until that request the previous checkpoint of that name stays readable. A save that died
  before it leaves data objects without metadata, which loading reports as incomplete (see
  [Note: sharded checkpoint layout]).

Before anything is written to a URL, every rank checks that it can reach the storage (the backend is
installed, the endpoint answers, the bucket exists) and the ranks agree, so an unreachable URL fails on
every rank with one error before any rank writes. Credentials and endpoints come from the backend's own
configuration (environment variables, config files, ``fsspec``'s config); buckets are never created.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import fsspec
import fsspec.core
import fsspec.utils
from fsspec import AbstractFileSystem

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.validate import agree_on_error

__all__ = [
    "METADATA",
    "REMOTE_OWNER",
    "Location",
    "Remote",
    "children",
    "incomplete_error",
    "is_url",
    "locate",
    "locate_checked",
    "remote_kind",
    "remove_checkpoint",
    "size_of",
    "storage_error",
]

METADATA = ".metadata"  # DCP's metadata file: a sharded checkpoint is complete once it exists
REMOTE_OWNER = ".flatshard-owner-"  # + the save id: a URL save's owner object (see [Note: stale temporaries])
_LOCAL_PROTOCOLS = ("file", "local")
_ENDPOINT_HINT = (
    "check that every node reaches the storage: the endpoint (for an S3-compatible server AWS_ENDPOINT_URL "
    "or FSSPEC_S3_ENDPOINT_URL), the network, and the credentials the fsspec backend reads (for s3:// "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
)


@dataclass(frozen=True, eq=False)
class Remote:
    """A checkpoint at a URL: the URL as given (no trailing ``/``), its filesystem and the path on it."""

    url: str
    fs: AbstractFileSystem
    path: str

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> Remote:
        return Remote(f"{self.url}/{name}", self.fs, f"{self.path}/{name}")

    def refresh(self) -> None:
        """Forget cached listings: other ranks and processes write here too."""
        self.fs.invalidate_cache(self.path)


Location = Path | Remote


def is_url(path: str | os.PathLike[str] | Remote) -> bool:
    """Whether ``path`` is a URL of a non-local fsspec filesystem (decided from the text alone)."""
    if isinstance(path, Remote):
        return True
    if isinstance(path, Path):
        return False
    return fsspec.utils.get_protocol(os.fspath(path)) not in _LOCAL_PROTOCOLS


def locate(path: str | os.PathLike[str] | Remote) -> Location:
    """A local :class:`~pathlib.Path`, or a :class:`Remote` for a URL (see [Note: checkpoint storage]).

    Raises :class:`CheckpointError` when the URL's fsspec backend is not installed or its protocol is
    unknown, or for a local path that is a URL whose ``//`` was collapsed.
    """
    if isinstance(path, Remote):
        return path
    text = os.fspath(path)
    if not is_url(path):
        local = Path(fsspec.core.strip_protocol(text)) if "://" in text else Path(path)
        _refuse_collapsed_url(local)
        return local
    protocol = fsspec.utils.get_protocol(text)
    try:
        fs, fs_path = fsspec.core.url_to_fs(text)
    except ImportError as err:
        raise CheckpointError(
            f"Checkpoint URL {text}: no fsspec backend for '{protocol}://' is installed ({err}). HINT: install "
            f"it on every node (s3:// needs s3fs, gs:// gcsfs, az:// adlfs). Nothing was written or read."
        ) from err
    except ValueError as err:
        raise CheckpointError(
            f"Checkpoint URL {text}: {err}. HINT: use a URL whose protocol fsspec knows (s3://, gs://, az://, "
            "memory://, file://, ...) or a local path. Nothing was written or read."
        ) from err
    return Remote(text.rstrip("/"), fs, str(fs_path).rstrip("/"))


def _refuse_collapsed_url(path: Path) -> None:
    known = set(fsspec.available_protocols())
    for part in path.parts[:-1]:
        scheme = part[:-1]
        if part.endswith(":") and len(scheme) > 1 and scheme.lower() in known:
            rest = str(path).split(part, 1)[1].lstrip("/")
            raise CheckpointError(
                f"Checkpoint path {path} looks like the URL {scheme}://{rest} whose '//' was collapsed by "
                f"pathlib.Path or os.path; refusing to write or read a local directory named {part!r}. HINT: pass "
                f"the URL as a string ('{scheme}://{rest}'); for a local directory pass a plain path (Lightning's "
                "ModelCheckpoint turns a file:// dirpath into such a path: give it the plain path)."
            )


def locate_checked(path: str | os.PathLike[str] | Remote) -> Location:
    """:func:`locate`, and for a URL a check on every rank that its storage answers; collective for URLs.

    If any rank cannot reach the storage, every rank raises (the failing one its own error), before anything
    is written. Call it on every rank.
    """
    if not is_url(path):
        return locate(path)
    location: Location | None = None
    error: CheckpointError | None = None
    try:
        location = locate(path)
        assert isinstance(location, Remote)
        _probe(location)
    except CheckpointError as err:
        error = err
    agree_on_error(error, "Checking the checkpoint storage")
    assert location is not None  # agree_on_error raised otherwise
    return location


def _probe(remote: Remote) -> None:
    """Raise :class:`CheckpointError` unless ``remote``'s storage answers and, on an object store, its bucket
    exists (never created here: DCP's ``makedirs`` would create a missing S3 bucket)."""
    fs = remote.fs
    bucket = ""
    split = getattr(fs, "split_path", None)  # object stores (s3fs, gcsfs, adlfs): bucket, key, version
    try:
        if split is None:
            fs.exists(remote.path)
            return
        bucket, key = split(remote.path)[:2]
        if not key:
            raise CheckpointError(
                f"Checkpoint URL {remote.url} names a whole bucket. HINT: name a checkpoint inside it "
                f"({remote.url}/run/last.ckpt). Nothing was written or read."
            )
        try:
            fs.info(bucket)
        except PermissionError:  # may read and write objects without reading the bucket itself
            fs.exists(remote.path)
    except FileNotFoundError as err:
        raise CheckpointError(
            f"Checkpoint URL {remote.url}: the bucket {bucket!r} does not exist or is not visible with these "
            f"credentials ({type(err).__name__}: {err}). HINT: create the bucket first or fix the URL; flatshard "
            "never creates buckets. Nothing was written or read."
        ) from err
    except PermissionError as err:
        raise CheckpointError(
            f"Checkpoint URL {remote.url}: access denied ({err}). HINT: check the credentials the fsspec backend "
            "reads (for s3:// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket's "
            "permissions. Nothing was written or read."
        ) from err
    except Exception as err:
        raise storage_error(remote, err, "reach its storage") from err


def storage_error(remote: Remote, err: BaseException, doing: str) -> CheckpointError:
    """The error for a storage call that failed (connection, endpoint, credentials)."""
    return CheckpointError(
        f"Checkpoint URL {remote.url}: could not {doing} ({type(err).__name__}: {err}). HINT: {_ENDPOINT_HINT}."
    )


def children(remote: Remote) -> dict[str, dict[str, Any]]:
    """The objects directly under ``remote`` by name, with their fsspec info (fresh, not cached)."""
    remote.refresh()
    try:
        entries = remote.fs.ls(remote.path, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as err:
        raise storage_error(remote, err, "list it") from err
    own = remote.path.strip("/")
    out = {}
    for entry in entries:
        full = str(entry["name"]).strip("/")
        if full != own:  # listing a file names the file itself
            out[full.rsplit("/", 1)[-1]] = entry
    return out


def remote_kind(remote: Remote) -> Literal["sharded", "incomplete", "file", "missing"]:
    """What is at ``remote``: a sharded directory (its metadata exists), objects under it without metadata
    (an unfinished sharded save), one object (a full file), or nothing."""
    remote.refresh()
    try:
        if remote.fs.exists(remote.child(METADATA).path):
            return "sharded"
        info = remote.fs.info(remote.path)
    except FileNotFoundError:
        return "missing"
    except Exception as err:
        raise storage_error(remote, err, "read it") from err
    return "file" if info.get("type") == "file" else "incomplete"


def incomplete_error(remote: Remote) -> CheckpointError:
    names = sorted(children(remote))
    return CheckpointError(
        f"Sharded checkpoint {remote.url} is incomplete: it holds {len(names)} objects ({names[:5]}) but no "
        f"{METADATA} object. The metadata object is written last, so the save that wrote these did not finish "
        "(or this is not a checkpoint). HINT: use an earlier checkpoint, or save to this URL again (a complete "
        "save replaces these objects). Nothing was loaded."
    )


def remove_checkpoint(path: str | os.PathLike[str] | Remote) -> None:
    """Delete a checkpoint file or sharded directory, local or at a URL; nothing if it does not exist.

    A directory's metadata goes first, so a removal that is interrupted leaves a directory that reads as
    incomplete, never one that reads as a checkpoint with missing data.
    """
    location = locate(path)
    if isinstance(location, Path):
        if location.is_dir() and not location.is_symlink():
            (location / METADATA).unlink(missing_ok=True)
            shutil.rmtree(location)
        elif location.exists() or location.is_symlink():
            location.unlink()
        return
    kind = remote_kind(location)
    try:
        if kind == "sharded":
            location.fs.rm_file(location.child(METADATA).path)
        if kind != "missing":
            location.fs.rm(location.path, recursive=True)
    except FileNotFoundError:
        pass
    except Exception as err:
        raise storage_error(location, err, "remove it") from err
    finally:
        location.refresh()


def size_of(location: Location) -> int:
    """The size in bytes of a checkpoint file."""
    if isinstance(location, Path):
        return location.stat().st_size
    try:
        return int(location.fs.size(location.path) or 0)
    except Exception as err:
        raise storage_error(location, err, "read its size") from err
