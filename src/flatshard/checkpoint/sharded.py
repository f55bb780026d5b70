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

Writes go to a hidden sibling directory that is renamed into place once every rank has finished, so a
crash mid-save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import inspect
import io
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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

from flatshard.checkpoint.files import CheckpointError, fsync_dir
from flatshard.engine import ParamShard, global_rank
from flatshard.version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ShardedReader",
    "is_sharded_checkpoint",
    "write_sharded_checkpoint",
]

FORMAT = "flatshard-sharded"
FORMAT_VERSION = 1
META_KEY = "flatshard/meta"
EXTRA_KEY = "extra"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a DCP checkpoint (``.metadata``)."""
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- planners
class _Object:
    """A placeholder for a non-tensor entry to be read."""


class _SavePlanner(DefaultSavePlanner):
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
def _flatten_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
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


def write_sharded_checkpoint(checkpoint: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a checkpoint dict whose ``state_dict`` / ``optimizer_states`` hold sharded state; all ranks call.

    See [Note: sharded checkpoint layout]. An existing checkpoint at ``path`` (file or directory) is
    replaced only once the new one is complete.
    """
    target = Path(path)
    tmp = target.parent / f".{target.name}.flatshard-tmp"
    old = target.parent / f".{target.name}.flatshard-old"
    entries, meta = _flatten_checkpoint(checkpoint)
    if global_rank() == 0:
        entries[META_KEY] = meta
        target.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save
        tmp.mkdir()
    _barrier()
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(entries, storage_writer=writer, planner=_SavePlanner(entries))
    _barrier()
    if global_rank() == 0:
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
    _barrier()
    return target


# ---------------------------------------------------------------------------------------------- reading
class ShardedReader:
    """Reads a sharded checkpoint directory: its metadata at once, data on request. Errors name the path."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._check_exists()
        try:
            self.metadata: Metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
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

    def _check_exists(self) -> None:
        if self.path.is_dir() and (self.path / ".metadata").is_file():
            return
        old = self.path.parent / f".{self.path.name}.flatshard-old"
        if not self.path.exists() and old.is_dir():
            raise CheckpointError(
                f"Sharded checkpoint {self.path} does not exist, but {old} does: a save was interrupted while "
                f"replacing it. HINT: `mv {old} {self.path}` restores the previous checkpoint."
            )
        if not self.path.exists():
            raise FileNotFoundError(f"Checkpoint {self.path} does not exist. HINT: check the path.")
        raise CheckpointError(
            f"{self.path} is not a sharded checkpoint: it has no .metadata file (an interrupted save, or the "
            "wrong directory). HINT: use an earlier checkpoint. Nothing was loaded."
        )

    def _check_files(self) -> None:
        """Every data file the metadata refers to exists and is long enough (truncation, missing shards)."""
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for rel, end in sorted(needed.items()):
            f = self.path / rel
            if not f.is_file():
                raise CheckpointError(
                    f"Sharded checkpoint {self.path} is missing its data file {rel} (a missing shard). HINT: copy "
                    "the whole directory, or use an earlier checkpoint. Nothing was loaded."
                )
            size = f.stat().st_size
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
        reader = dcp.FileSystemReader(str(self.path))
        distributed = dist.is_available() and dist.is_initialized()
        state = {k: _placeholder(v) for k, v in targets.items()}
        try:
            _dcp_load(state, reader, planner, no_dist=not distributed)
        except Exception as err:
            raise CheckpointError(
                f"Sharded checkpoint {self.path} could not be read ({type(err).__name__}: {err}). HINT: the "
                "directory is damaged or incomplete; use an earlier checkpoint."
            ) from err
        return planner.objects

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Read object entries on this process alone (no collective)."""
        planner = _LoadPlanner({k: OBJECT for k in keys})
        reader = dcp.FileSystemReader(str(self.path))
        try:
            _dcp_load({k: _placeholder(OBJECT) for k in keys}, reader, planner, no_dist=True)
        except Exception as err:
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
