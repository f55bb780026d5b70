"""DCP's file storage on an fsspec filesystem, for sharded checkpoints at URLs (see [Note: checkpoint storage]).

Data objects are named per save, ``meta.pt`` and ``.metadata`` are written last, each in one request, and only
then do the data objects of earlier saves of that name go (see [Note: sharded checkpoint layout]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
from collections.abc import Generator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from flatshard.checkpoint.dcp_layout import LIGHTNING_META
from flatshard.checkpoint.files import recording
from flatshard.checkpoint.storage import METADATA, REMOTE_OWNER, Remote, children

__all__ = ["RemoteReader", "RemoteWriter", "remove_save_objects", "remove_stale_objects"]

log = logging.getLogger(__name__)


def remove_stale_objects(target: Remote, keep: set[str]) -> None:
    """Delete what earlier saves of this name left (their data objects, or a full file of the same name) once
    the new metadata is in place; other objects under the prefix are not flatshard's and stay. A failure only
    leaves unreferenced objects behind."""
    try:
        for name, entry in children(target).items():
            ours = name.endswith(".distcp") or name.startswith(
                ".flatshard-"
            )  # data objects, markers of older flatshard versions
            if ours and name not in keep and entry.get("type") == "file":
                target.fs.rm_file(str(entry["name"]))
        target.refresh()
        if target.fs.info(target.path).get("type") == "file":  # an object store keeps "x" beside "x/..."
            target.fs.rm_file(target.path)
    except Exception as err:  # the checkpoint is complete: report, do not fail the save
        log.warning("flatshard: %s is saved, but objects of its previous save remain (%s).", target.url, err)
    finally:
        target.refresh()


def remove_save_objects(target: Remote, save_id: str) -> None:
    """Delete the data objects of one save (``__<rank>_<save id>_0.distcp``), which failed before its metadata
    was written (see [Note: save outcomes through the store]); a folder it left empty goes too. Never raises: a
    failure leaves only unreferenced objects, which the next save of that name deletes."""
    try:
        for name, entry in children(target).items():
            data = name.startswith("__") and f"_{save_id}_" in name and name.endswith(".distcp")
            if data or name == REMOTE_OWNER + save_id:
                target.fs.rm_file(str(entry["name"]))
        if not children(target) and target.fs.isdir(target.path):
            target.fs.rmdir(target.path)
    except Exception as err:
        log.warning("flatshard: objects of the failed save of %s remain (%s).", target.url, err)
    finally:
        target.refresh()


class _FsspecFiles(dcp_filesystem.FileSystem):
    """DCP's file operations on an fsspec filesystem (torch's own adapter replaces ``.metadata`` by removing
    and renaming, which on an object store leaves a moment without metadata)."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        try:
            with self.fs.open(os.fspath(path), mode) as stream, recording(stream) as recorded:
                yield recorded  # a dropped upload raised as itself, not as torch.save's "unexpected pos"
        except BaseException:
            if "r" not in mode:  # referenced by no metadata: a half-written object is only clutter
                with contextlib.suppress(Exception):
                    self.fs.rm_file(os.fspath(path))
            raise

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if not hasattr(self.fs, "split_path"):  # object stores have no directories (and would create buckets)
            self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly, never by DCP's guess

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.fs.rm_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [str(p) for p in self.fs.ls(os.fspath(path), detail=False)]


class RemoteWriter(dcp.FileSystemWriter):
    """DCP's file writer on an fsspec filesystem: data files named per save, ``.metadata`` written last in one
    request (see [Note: checkpoint storage])."""

    def __init__(self, target: Remote, save_id: str, extra: Mapping[str, Any] | None) -> None:
        super().__init__(target.url, single_file_per_rank=True, sync_files=False, overwrite=True)
        self._extra = extra
        self.fs = _FsspecFiles(target.fs)
        self.path = target.path
        self._target = target
        self._save_id = save_id
        self.written: list[str] = []  # data files of this save (coordinator only, after finish)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # No "existing checkpoint" warning: replacing one is the intent, and its metadata stays until ours lands.
        self.fs.mkdir(self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        return [  # "__<rank>_" -> "__<rank>_<save id>_": never overwrite a file the current metadata names
            dataclasses.replace(
                p,
                storage_data=dataclasses.replace(
                    p.storage_data, prefix=f"{p.storage_data.prefix}{self._save_id}_"
                ),
            )
            for p in plans
        ]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
        if version is not None:
            metadata.version = version
        self.written = sorted({info.relative_path for info in metadata.storage_data.values()})
        try:
            with contextlib.suppress(FileNotFoundError):  # no trace of the owner in a complete checkpoint
                self._target.fs.rm_file(self._target.child(REMOTE_OWNER + self._save_id).path)
            if self._extra is not None:
                buf = io.BytesIO()
                torch.save(dict(self._extra), buf)
                self._target.fs.pipe_file(self._target.child(LIGHTNING_META).path, buf.getvalue())
            self._target.fs.pipe_file(self._target.child(METADATA).path, pickle.dumps(metadata))
        finally:
            self._target.refresh()


class RemoteReader(dcp.FileSystemReader):
    """DCP's file reader on an fsspec filesystem."""

    def __init__(self, source: Remote) -> None:
        super().__init__(source.url)
        self.fs = _FsspecFiles(source.fs)
        self.path = source.path
