"""Sharded checkpoints: a ``torch.distributed.checkpoint`` directory of parameter pieces.

[Note: sharded checkpoint layout]
Each rank writes only what it holds, with no tensor communication (ranks exchange only DCP's small
save plans). Entries, by DCP key:

- ``flatshard/meta`` (object, rank 0): format name and version, the writer's world size and versions,
  the model's state-dict keys in order, tied-parameter aliases, and the full shape of every piece entry.
- ``extra`` (object, rank 0): the rest of the checkpoint dict (Lightning's epoch, loops, callbacks...).
- ``model/<key>``: a managed parameter as a 1-D tensor of its full ``numel``, written as one chunk per
  rank at the rank's offset (see [Note: sharded state]); buffers and other tensors whole (rank 0);
  non-tensor entries (``_extra_state``) as objects (rank 0).
- ``optim/<k>/groups`` (object, rank 0): optimizer ``k``'s param groups with parameter *names*.
- ``optim/<k>/state/<name>/<key>``: elementwise state as pieces like its parameter, the rest whole.

Reading asks DCP for the byte range this rank needs in the *reader's* layout, so a checkpoint loads on any
world size and wrap policy. Everything is validated (keys, shapes, optimizer groups, every data file
present and long enough) before a single value is read into the model.

Local writes go to a hidden sibling directory that is renamed into place once every rank has finished, so a
crash mid-save leaves the previous checkpoint as it was. At a URL (see [Note: checkpoint storage]) nothing can
be renamed: every rank writes its data object under a name unique to the save (``__<rank>_<save id>_0.distcp``),
rank 0 writes ``.metadata`` last in one request (an object store replaces an object whole), and only then
deletes the data objects of earlier saves of that name. A directory is complete exactly when its ``.metadata``
exists; one without it is reported as incomplete, not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.files import fsync_dir
from flatshard.checkpoint.storage import (
    METADATA,
    Location,
    Remote,
    children,
    incomplete_error,
    locate,
    locate_checked,
    remote_kind,
    storage_error,
)
from flatshard.engine import ParamShard, global_rank
from flatshard.version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "SavePlanner",
    "ShardedReader",
    "flatten_checkpoint",
    "is_sharded_checkpoint",
    "prepare_temporary",
    "replace_directory",
    "write_sharded_checkpoint",
]

FORMAT = "flatshard-sharded"
FORMAT_VERSION = 1
META_KEY = "flatshard/meta"
EXTRA_KEY = "extra"

log = logging.getLogger(__name__)


def is_sharded_checkpoint(path: str | os.PathLike[str] | Remote) -> bool:
    """Whether ``path`` (a local path or a URL) is a directory holding a DCP checkpoint (``.metadata``)."""
    p = locate(path)
    if isinstance(p, Remote):
        try:
            return remote_kind(p) == "sharded"
        except CheckpointError:
            return False
    return p.is_dir() and (p / METADATA).is_file()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- planners
class _Object:
    """A placeholder for a non-tensor entry to be read."""


class SavePlanner(DefaultSavePlanner):
    """Writes :class:`ParamShard` entries as chunks of a 1-D tensor; tensors whole; anything else pickled."""

    def __init__(self, entries: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = dict(entries)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, value in self._entries.items():
            if isinstance(value, ParamShard):
                n = value.local.numel()
                if n == 0:
                    continue
                offsets = torch.Size([value.offset])
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([n])),
                            properties=TensorProperties.create_from_tensor(value.local),
                            size=torch.Size([value.numel]),
                        ),
                    )
                )
            elif isinstance(value, torch.Tensor):
                offsets = torch.Size([0] * value.dim())
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=value.size()),
                            properties=TensorProperties.create_from_tensor(value),
                            size=value.size(),
                        ),
                    )
                )
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self._entries[write_item.index.fqn]
        if isinstance(value, ParamShard):
            value = value.local
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
                t = t.contiguous().clone()  # write exactly the piece, not the storage it views
            return t
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into :class:`ParamShard` targets (this rank's range), whole tensors, and objects."""

    def __init__(self, targets: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets = dict(targets)
        self.objects: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, target in self._targets.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(target, _Object):
                items.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=MetadataIndex(fqn),
                        dest_offsets=torch.Size((0,)),
                        storage_index=MetadataIndex(fqn),
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
                continue
            assert isinstance(md, TensorStorageMetadata)
            if isinstance(target, ParamShard):
                n = target.local.numel()
                if n == 0:
                    continue
                chunk = ChunkStorageMetadata(offsets=torch.Size([target.offset]), sizes=torch.Size([n]))
            else:
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.size())
            items.extend(create_read_items_for_chunk_list(fqn, md, [chunk]))
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[read_item.dest_index.fqn]
        tensor = target.local if isinstance(target, ParamShard) else target
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the target: the data is already in place


# ---------------------------------------------------------------------------------------------- writing
def flatten_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP entries and the meta record for a checkpoint dict holding sharded model/optimizer state."""
    rank0 = global_rank() == 0
    entries: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    aliases: dict[str, str] = {}

    def put(fqn: str, value: Any) -> None:
        if isinstance(value, ParamShard):
            if value.numel == 0:  # nothing to cut: store the (empty) tensor whole
                if rank0:
                    entries[fqn] = value.local.reshape(value.shape)
                return
            entries[fqn] = value
            shapes[fqn] = list(value.shape)
        elif rank0:
            entries[fqn] = value

    model = checkpoint.get("state_dict")
    model_keys: list[str] | None = None
    if model is not None:
        if not isinstance(model, Mapping):
            raise TypeError(f"checkpoint['state_dict'] must be a mapping, got {type(model).__name__}.")
        model_keys = list(model)
        first_key: dict[int, str] = {}
        for key, value in model.items():
            if isinstance(value, ParamShard) and id(value) in first_key:
                aliases[key] = first_key[id(value)]
                continue
            if isinstance(value, ParamShard):
                first_key[id(value)] = key
            put(f"model/{key}", value)
    optimizers = checkpoint.get("optimizer_states")
    if optimizers is not None:
        for k, optim in enumerate(optimizers):
            if not (isinstance(optim, Mapping) and "state" in optim and "param_groups" in optim):
                raise TypeError(
                    f"checkpoint['optimizer_states'][{k}] is not a sharded optimizer state (needs 'state' and "
                    "'param_groups' keyed by parameter name)."
                )
            if rank0:
                entries[f"optim/{k}/groups"] = optim["param_groups"]
            for name, state in optim["state"].items():
                for key, value in state.items():
                    put(f"optim/{k}/state/{name}/{key}", value)
    if rank0:
        entries[EXTRA_KEY] = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "world_size": _world(),
        "torch_version": torch.__version__,
        "flatshard_version": __version__,
        "model_keys": model_keys,
        "aliases": aliases,
        "shapes": shapes,
        "num_optimizers": None if optimizers is None else len(optimizers),
    }
    return entries, meta


def write_sharded_checkpoint(
    checkpoint: Mapping[str, Any], path: str | os.PathLike[str] | Remote
) -> Path | str:
    """Write a checkpoint dict whose ``state_dict`` / ``optimizer_states`` hold sharded state; all ranks call.

    See [Note: sharded checkpoint layout]. ``path`` is a local directory or a URL; an existing checkpoint there
    (file or directory) is replaced only once the new one is complete. Returns the path (the URL for a URL).
    """
    location = locate_checked(path)  # a URL's storage answers on every rank before anything is written
    entries, meta = flatten_checkpoint(checkpoint)
    if isinstance(location, Remote):
        return _write_remote(entries, meta, location)
    target = location
    if global_rank() == 0:
        entries[META_KEY] = meta
    tmp = prepare_temporary(target)
    _dcp_save(entries, dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True))
    _barrier()
    if global_rank() == 0:
        replace_directory(tmp, target)
    _barrier()
    return target


def prepare_temporary(target: Path) -> Path:
    """The empty hidden sibling a local save of ``target`` writes into (created by rank 0); all ranks call."""
    tmp = target.parent / f".{target.name}.flatshard-tmp"
    if global_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save
        tmp.mkdir()
    _barrier()
    return tmp


def replace_directory(tmp: Path, target: Path) -> None:
    """Rank 0, once every rank's data and the metadata are in ``tmp``: rename it into place, the old one aside
    first and deleted after (see [Note: sharded checkpoint layout])."""
    old = target.parent / f".{target.name}.flatshard-old"
    fsync_dir(tmp)
    if target.exists() or target.is_symlink():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()


def _dcp_save(entries: dict[str, Any], writer: dcp.FileSystemWriter) -> None:
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(entries, storage_writer=writer, planner=SavePlanner(entries))


def _write_remote(entries: dict[str, Any], meta: dict[str, Any], target: Remote) -> str:
    """A sharded checkpoint at a URL: data objects first, ``.metadata`` last, then earlier saves' data objects
    go (see [Note: checkpoint storage])."""
    if global_rank() == 0:
        entries[META_KEY] = meta
    writer = _RemoteWriter(target, uuid.uuid4().hex[:12])  # rank 0's (the coordinator's) names every file
    try:
        _dcp_save(entries, writer)
    except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
        raise storage_error(target, err, "write the sharded checkpoint") from err
    if global_rank() == 0:
        _remove_stale_objects(target, keep=set(writer.written))
    _barrier()
    return target.url


def _remove_stale_objects(target: Remote, keep: set[str]) -> None:
    """Delete what earlier saves of this name left (their data objects, or a full file of the same name) once
    the new metadata is in place; other objects under the prefix are not flatshard's and stay. A failure only
    leaves unreferenced objects behind."""
    try:
        for name, entry in children(target).items():
            if name.endswith(".distcp") and name not in keep and entry.get("type") == "file":
                target.fs.rm_file(str(entry["name"]))
        target.refresh()
        if target.fs.info(target.path).get("type") == "file":  # an object store keeps "x" beside "x/..."
            target.fs.rm_file(target.path)
    except Exception as err:  # the checkpoint is complete: report, do not fail the save
        log.warning("flatshard: %s is saved, but objects of its previous save remain (%s).", target.url, err)
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
            with self.fs.open(os.fspath(path), mode) as stream:
                yield stream
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


class _RemoteWriter(dcp.FileSystemWriter):
    """DCP's file writer on an fsspec filesystem: data files named per save, ``.metadata`` written last in one
    request (see [Note: checkpoint storage])."""

    def __init__(self, target: Remote, save_id: str) -> None:
        super().__init__(target.url, single_file_per_rank=True, sync_files=False, overwrite=True)
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
            self._target.fs.pipe_file(self._target.child(METADATA).path, pickle.dumps(metadata))
        finally:
            self._target.refresh()


class _RemoteReader(dcp.FileSystemReader):
    """DCP's file reader on an fsspec filesystem."""

    def __init__(self, source: Remote) -> None:
        super().__init__(source.url)
        self.fs = _FsspecFiles(source.fs)
        self.path = source.path


# ---------------------------------------------------------------------------------------------- reading
class ShardedReader:
    """Reads a sharded checkpoint directory: its metadata at once, data on request. Errors name the path."""

    def __init__(self, path: str | os.PathLike[str] | Remote) -> None:
        self.location: Location = locate(path)
        self.path: Path | str = self.location if isinstance(self.location, Path) else self.location.url
        self._check_exists()
        try:
            self.metadata: Metadata = self._storage_reader().read_metadata()
        except Exception as err:
            raise CheckpointError(
                f"Sharded checkpoint {self.path}: its .metadata file could not be read ({type(err).__name__}: "
                f"{err}). HINT: the save was interrupted or the directory is damaged; use an earlier checkpoint."
            ) from err
        self.entries = self.metadata.state_dict_metadata
        if META_KEY not in self.entries:
            raise CheckpointError(
                f"Sharded checkpoint {self.path} was not written by flatshard (no {META_KEY!r} entry). HINT: load "
                "torch.distributed.checkpoint directories of other tools with their own loader."
            )
        self._check_files()
        self.meta: dict[str, Any] = self.read_objects([META_KEY])[META_KEY]
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(
                f"Sharded checkpoint {self.path} has an unknown format {self.meta.get('format')!r}."
            )
        version = self.meta.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"Sharded checkpoint {self.path} has format version {version!r}, written by flatshard "
                f"{self.meta.get('flatshard_version')}; this flatshard ({__version__}) reads versions up "
                f"to {FORMAT_VERSION}. HINT: upgrade flatshard to load it. Nothing was loaded."
            )

    def _storage_reader(self) -> dcp.FileSystemReader:
        if isinstance(self.location, Remote):
            return _RemoteReader(self.location)
        return dcp.FileSystemReader(str(self.location))

    def _check_exists(self) -> None:
        if isinstance(self.location, Remote):
            self._check_remote_exists(self.location)
            return
        path = self.location
        if path.is_dir() and (path / METADATA).is_file():
            return
        old = path.parent / f".{path.name}.flatshard-old"
        if not path.exists() and old.is_dir():
            raise CheckpointError(
                f"Sharded checkpoint {path} does not exist, but {old} does: a save was interrupted while "
                f"replacing it. HINT: `mv {old} {path}` restores the previous checkpoint."
            )
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint {path} does not exist. HINT: check the path.")
        raise CheckpointError(
            f"{path} is not a sharded checkpoint: it has no .metadata file (an interrupted save, or the "
            "wrong directory). HINT: use an earlier checkpoint. Nothing was loaded."
        )

    @staticmethod
    def _check_remote_exists(source: Remote) -> None:
        kind = remote_kind(source)
        if kind == "incomplete":
            raise incomplete_error(source)
        if kind == "missing":
            raise FileNotFoundError(
                f"Checkpoint {source.url} does not exist. HINT: check the URL (and that the endpoint and "
                "credentials point at the storage that holds it)."
            )
        if kind == "file":
            raise CheckpointError(
                f"{source.url} is not a sharded checkpoint: it is one object (a full checkpoint file?). HINT: load "
                "it as a file (flatshard.load_checkpoint or a strategy read both). Nothing was loaded."
            )

    def _sizes(self) -> dict[str, int]:
        """Each file's size by its name relative to the checkpoint (only those that exist)."""
        if isinstance(self.location, Remote):
            return {name: int(e.get("size") or 0) for name, e in children(self.location).items()}
        return {f.name: f.stat().st_size for f in self.location.iterdir() if f.is_file()}

    def _check_files(self) -> None:
        """Every data file the metadata refers to exists and is long enough (truncation, missing shards)."""
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        sizes = self._sizes()
        for rel, end in sorted(needed.items()):
            if rel not in sizes:
                raise CheckpointError(
                    f"Sharded checkpoint {self.path} is missing its data file {rel} (a missing shard). HINT: copy "
                    "the whole directory, or use an earlier checkpoint. Nothing was loaded."
                )
            size = sizes[rel]
            if size < end:
                raise CheckpointError(
                    f"Sharded checkpoint {self.path}: data file {rel} is truncated ({size} bytes, the metadata "
                    f"needs {end}). HINT: use an earlier checkpoint. Nothing was loaded."
                )

    # ------------------------------------------------------------------ entries
    def tensor_meta(self, fqn: str) -> TensorStorageMetadata | None:
        md = self.entries.get(fqn)
        return md if isinstance(md, TensorStorageMetadata) else None

    def is_object(self, fqn: str) -> bool:
        return isinstance(self.entries.get(fqn), BytesStorageMetadata)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.entries if k.startswith(prefix)]

    def full_shape(self, fqn: str) -> torch.Size:
        """The logical shape of an entry (pieces are stored flat)."""
        if fqn in self.meta["shapes"]:
            return torch.Size(self.meta["shapes"][fqn])
        md = self.tensor_meta(fqn)
        assert md is not None, fqn
        return md.size

    def is_piece(self, fqn: str) -> bool:
        return fqn in self.meta["shapes"]

    # ------------------------------------------------------------------ reads
    def read(self, targets: Mapping[str, Any]) -> dict[str, Any]:
        """Fill ``targets`` (ParamShard / tensor / :data:`OBJECT`) in place; returns the objects read.

        Collective when a process group is initialised (all ranks must call with the same keys).
        """
        planner = _LoadPlanner(targets)
        reader = self._storage_reader()
        distributed = dist.is_available() and dist.is_initialized()
        state = {k: _placeholder(v) for k, v in targets.items()}
        try:
            _dcp_load(state, reader, planner, no_dist=not distributed)
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise CheckpointError(
                f"Sharded checkpoint {self.path} could not be read ({type(err).__name__}: {err}). HINT: the "
                "directory is damaged or incomplete; use an earlier checkpoint."
            ) from err
        return planner.objects

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Read object entries on this process alone (no collective)."""
        planner = _LoadPlanner({k: OBJECT for k in keys})
        reader = self._storage_reader()
        try:
            _dcp_load({k: _placeholder(OBJECT) for k in keys}, reader, planner, no_dist=True)
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise CheckpointError(
                f"Sharded checkpoint {self.path}: entries {list(keys)} could not be read ({type(err).__name__}: "
                f"{err}). HINT: use an earlier checkpoint."
            ) from err
        return planner.objects


OBJECT = _Object()


def _dcp_load(state: dict[str, Any], reader: Any, planner: Any, *, no_dist: bool) -> None:
    if not no_dist:
        dcp.load(state, storage_reader=reader, planner=planner)
        return
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        else:  # torch releases whose dcp.load has no ``no_dist``
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            _load_state_dict(state, reader, no_dist=True, planner=planner)


def _placeholder(target: Any) -> Any:
    """What DCP's own bookkeeping sees for a target (it never reads these values)."""
    if isinstance(target, ParamShard):
        return target.local
    if isinstance(target, torch.Tensor):
        return target
    return None
