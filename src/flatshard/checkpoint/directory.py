"""Sharded checkpoints: a ``torch.distributed.checkpoint`` directory of parameter pieces.

[Note: sharded checkpoint layout]
Each rank writes only what it holds, with no tensor communication (ranks exchange only DCP's small
save plans). Since format version 2 the entries follow torch's and Lightning's sharded layout, tensors under
their global shapes (see [Note: DCP-native layout] in ``flatshard.checkpoint.dcp_layout``):

- ``<model>.<key>``: a managed parameter as the n-d boxes of each rank's piece; buffers and other tensors
  whole (rank 0); non-tensor entries (``_extra_state``) as objects (rank 0).
- ``<optimizer>.param_groups.<i>.<field>`` (objects, rank 0): the param groups, ``params`` as parameter *names*;
  ``<optimizer>.state.<name>.<key>``: elementwise state as boxes like its parameter, the rest whole.
- ``flatshard.meta`` (object, rank 0): format name and version, the writer's world size and versions, the
  model's state-dict keys in order, tied-parameter aliases and the model's and optimizers' names.
- ``flatshard.extra`` (object, rank 0), and the file ``meta.pt``: the rest of the checkpoint dict
  (Lightning's epoch, loops, callbacks...).

Version 1 directories (``flatshard/meta``, ``model/<key>`` as 1-D pieces of the flattened tensor, ``extra``)
still load. Reading asks DCP for the boxes this rank needs in the *reader's* layout, so a checkpoint loads on
any world size and wrap policy. Everything is validated (keys, shapes, optimizer groups, every data file
present and long enough) before a single value is read into the model.

Local writes go to a hidden sibling directory that is renamed into place once every rank has finished, so a
crash mid-save leaves the previous checkpoint as it was. At a URL (see [Note: checkpoint storage]) nothing can
be renamed: every rank writes its data object under a name unique to the save (``__<rank>_<save id>_0.distcp``),
rank 0 writes ``meta.pt`` and then ``.metadata`` last in one request (an object store replaces an object whole),
and only then deletes the data objects of earlier saves of that name. A directory is complete exactly when its
``.metadata`` exists; one without it is reported as incomplete, not read. (Until ``.metadata`` lands, the
previous checkpoint's ``meta.pt`` at a URL is already the new one: flatshard reads ``flatshard.extra``, so
only other tools' readers could see the mix, and only after an interrupted save.)
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

from flatshard.checkpoint.dcp_layout import (
    LIGHTNING_META,
    Box,
    Layout,
    Names,
    StoredPiece,
    fill_pieces,
    find_pieces,
    foreign_layout,
    optimizer_state_entries,
    shard_boxes,
    split_pieces,
    unclaimed_keys,
)
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.remote_dcp import RemoteReader
from flatshard.checkpoint.storage import (
    METADATA,
    Location,
    Remote,
    children,
    incomplete_error,
    locate,
    remote_kind,
)
from flatshard.checkpoint.validate import check_chunks
from flatshard.engine import ParamShard, global_rank
from flatshard.version import __version__

__all__ = [
    "EXTRA_KEY",
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "Flattened",
    "SavePlanner",
    "ShardedReader",
    "flatten_checkpoint",
    "is_sharded_checkpoint",
]

FORMAT = "flatshard-sharded"
FORMAT_VERSION = 2
META_KEY = "flatshard.meta"
EXTRA_KEY = "flatshard.extra"
_META_KEY_V1, _EXTRA_KEY_V1 = "flatshard/meta", "extra"  # format version 1

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


# ---------------------------------------------------------------------------------------------- planners
class _Object:
    """A placeholder for a non-tensor entry to be read."""

    __slots__ = ()


class SavePlanner(DefaultSavePlanner):
    """Writes :class:`ParamShard` entries as the boxes of their global shape, tensors whole, anything else
    pickled; records every key's path in the metadata's ``planner_data`` (see [Note: DCP-native layout])."""

    def __init__(
        self, entries: Mapping[str, Any], paths: Mapping[str, tuple[str | int, ...]] | None = None
    ) -> None:
        # flatten_state_dict=True only so that DCP merges the plans' planner_data into the metadata; the entries
        # are flat already, and set_up_planner below does not flatten them.
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._entries = dict(entries)
        self._paths = {k: v for k, v in (paths or {}).items() if k in self._entries}
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, value in self._entries.items():
            if isinstance(value, ParamShard):
                for box in shard_boxes(value):
                    offsets = torch.Size(box.offsets)
                    view = value.local[box.start - value.offset : box.start - value.offset + box.numel]
                    self._views[(fqn, box.offsets)] = view.view(box.sizes)
                    items.append(
                        WriteItem(
                            index=MetadataIndex(fqn, offsets),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)),
                                properties=TensorProperties.create_from_tensor(value.local),
                                size=torch.Size(value.shape),
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
        self.plan = SavePlan(items, planner_data=self._paths)
        return self.plan

    def entry(self, fqn: str) -> Any:
        """The value to be written under ``fqn``."""
        return self._entries[fqn]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        value = self._entries[fqn]
        if isinstance(value, ParamShard):
            assert write_item.index.offset is not None
            value = self._views[(fqn, tuple(write_item.index.offset))]
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
    """Reads into :class:`ParamShard` targets (this rank's range, as boxes of the stored global shape or, for
    format version 1, as a range of the stored flat tensor), whole tensors, and objects."""

    def __init__(self, targets: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets = dict(targets)
        self._views: dict[str, list[torch.Tensor]] = {}
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
                boxes = _read_boxes(fqn, md.size, target)
                start = target.offset
                self._views[fqn] = [
                    target.local[b.start - start : b.start - start + b.numel].view(b.sizes) for b in boxes
                ]
                chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes]
            else:
                self._views[fqn] = [target]
                chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.size())]
            if chunks:
                items.extend(create_read_items_for_chunk_list(fqn, md, chunks))
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        tensor = self._views[index.fqn][index.index or 0]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the target: the data is already in place


def _read_boxes(fqn: str, stored: torch.Size, target: ParamShard) -> list[Box]:
    """The boxes of ``target``'s range in the stored tensor: of its global shape, or of a flat one (version 1)."""
    n = target.local.numel()
    if tuple(stored) == tuple(target.shape):
        return shard_boxes(target)
    if len(stored) == 1 and target.block is None and stored[0] == target.numel:
        return [Box((target.offset,), (n,), target.offset)] if n else []
    raise CheckpointError(
        f"The checkpoint stores {fqn!r} with shape {tuple(stored)}, expected {tuple(target.shape)} (or flat). "
        "HINT: load a checkpoint of the same model. Nothing was loaded."
    )


# ---------------------------------------------------------------------------------------------- writing
@dataclass
class Flattened:
    """A checkpoint dict as DCP entries (see [Note: sharded checkpoint layout]).

    Attributes:
        entries: DCP key -> ParamShard / tensor / object; rank 0 also holds ``flatshard.meta`` and
            ``flatshard.extra``.
        paths: DCP key -> its path in the nested dict (the metadata's ``planner_data``).
        extra: the checkpoint's other entries (rank 0 writes them to ``meta.pt`` too), or ``None`` elsewhere.
    """

    entries: dict[str, Any]
    paths: dict[str, tuple[str | int, ...]]
    extra: dict[str, Any] | None


def flatten_checkpoint(checkpoint: Mapping[str, Any], names: Names | None = None) -> Flattened:
    """DCP entries for a checkpoint dict holding sharded model/optimizer state (``state_dict`` and
    ``optimizer_states`` as :func:`flatshard.sharded_model_state_dict` and
    :func:`flatshard.sharded_optim_state_dict` give them); ``names`` are the model's and optimizers' names
    (default ``model`` and ``optimizer_<k>``, as Lightning's FSDPStrategy)."""
    names = names or Names()
    rank0 = global_rank() == 0
    entries: dict[str, Any] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    aliases: dict[str, str] = {}

    def put(path: tuple[str | int, ...], value: Any) -> None:
        fqn = ".".join(map(str, path))
        if isinstance(value, ParamShard) and value.numel == 0:  # nothing to cut: store the empty tensor whole
            value = value.local.reshape(value.shape)
        if isinstance(value, ParamShard) or rank0:
            entries[fqn] = value
            paths[fqn] = path

    model = checkpoint.get("state_dict")
    model_keys: list[str] | None = None
    if model is not None:
        if not isinstance(model, Mapping):
            raise TypeError(f"checkpoint['state_dict'] must be a mapping, got {type(model).__name__}.")
        model_keys = list(model)
        first_key: dict[int, str] = {}
        for key, value in model.items():
            if isinstance(value, ParamShard):
                if id(value) in first_key:
                    aliases[key] = first_key[id(value)]  # stored again under this name for other readers
                else:
                    first_key[id(value)] = key
            put((names.model, key), value)
    optimizers = checkpoint.get("optimizer_states")
    optimizer_names: list[str] = []
    if optimizers is not None:
        for k, optim in enumerate(optimizers):
            if not (isinstance(optim, Mapping) and "state" in optim and "param_groups" in optim):
                raise TypeError(
                    f"checkpoint['optimizer_states'][{k}] is not a sharded optimizer state (needs 'state' and "
                    "'param_groups' keyed by parameter name)."
                )
            name = names.optimizer(k)
            optimizer_names.append(name)
            for i, group in enumerate(optim["param_groups"]):
                for field_name, value in group.items():  # as torch's flattening splits them
                    put((name, "param_groups", i, field_name), value)
            for param, state in optim["state"].items():
                for key, value in state.items():
                    put((name, "state", param, key), value)
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    rest, pieces = split_pieces(
        rest, ParamShard
    )  # the EMA callback's weights (see [Note: DCP-native layout])
    for path, piece in pieces:
        put(("flatshard", "pieces", *path), piece)
    extra = None
    if rank0:
        extra = rest
        put(("flatshard", "extra"), extra)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "world_size": _world(),
            "torch_version": torch.__version__,
            "flatshard_version": __version__,
            "model_keys": model_keys,
            "aliases": aliases,
            "model_name": names.model,
            "optimizer_names": None if optimizers is None else optimizer_names,
        }
        put(("flatshard", "meta"), meta)
    return Flattened(entries, paths, extra)


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
        self._check_files()
        check_chunks(self.path, self.metadata)  # gaps, overlaps, chunks outside (see [Note: chunk coverage])
        meta_key = next((k for k in (META_KEY, _META_KEY_V1) if k in self.entries), None)
        self.meta: dict[str, Any] = {} if meta_key is None else self.read_objects([meta_key])[meta_key]
        #: the flatshard format version; 0 for a DCP checkpoint another tool wrote (see [Note: DCP-native layout])
        self.version = 0
        if meta_key is None:
            return
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
        self.version = version

    def _storage_reader(self) -> dcp.FileSystemReader:
        if isinstance(self.location, Remote):
            return RemoteReader(self.location)
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
        if path.is_file():
            kind = (
                "a full checkpoint file (torch.save), already one file"
                if zipfile.is_zipfile(path)
                else "a file, not a directory"
            )
            raise CheckpointError(
                f"{path} is not a sharded checkpoint directory: it is {kind}. HINT: load a full file directly "
                "(flatshard.load_checkpoint, fit(ckpt_path=...), torch.load); `flatshard consolidate FILE "
                "OUT.safetensors` exports its weights. Nothing was loaded."
            )
        raise CheckpointError(
            f"{path} is not a sharded checkpoint: the directory has no .metadata file (an interrupted save, or "
            "the wrong directory). HINT: use an earlier checkpoint. Nothing was loaded."
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

    def full_shape(self, fqn: str) -> torch.Size:
        """The logical shape of an entry (format version 1 stored pieces flat)."""
        if self.is_piece(fqn):
            return torch.Size(self.meta["shapes"][fqn])
        md = self.tensor_meta(fqn)
        assert md is not None, fqn
        return md.size

    def is_piece(self, fqn: str) -> bool:
        """Whether the entry is stored flat, as format version 1 stored parameter pieces."""
        return self.version == 1 and fqn in self.meta["shapes"]

    def layout(
        self,
        module_keys: Sequence[str] | None = None,
        names: Names | None = None,
        num_optimizers: int | None = None,
    ) -> Layout:
        """Where this checkpoint keeps each part (see [Note: DCP-native layout]). For a checkpoint another tool
        wrote, ``module_keys`` (the loading model's keys), ``names`` (a Fabric state's names) and
        ``num_optimizers`` guide the search."""
        meta = self.meta
        if self.version == 0:
            return foreign_layout(self.entries, module_keys, names, num_optimizers)
        keys = meta.get("model_keys")
        aliases: dict[str, str] = dict(meta.get("aliases") or {})
        if self.version == 1:
            count = meta.get("num_optimizers")
            model = None if keys is None else {k: "model/" + aliases.get(k, k) for k in keys}
            optimizers = []
            for k in range(count or 0):
                head = f"optim/{k}/state/"
                state = {
                    f: (f[len(head) :].rpartition("/")[0], f.rpartition("/")[2])
                    for f in self.entries
                    if f.startswith(head)
                }
                optimizers.append((f"optim/{k}/groups", state))
            unclaimed = unclaimed_keys(self.entries, "model/", set(keys or ()))
            return Layout(1, model, aliases, optimizers, _EXTRA_KEY_V1, count is not None, unclaimed)
        name = meta["model_name"]
        model = None if keys is None else {k: f"{name}.{aliases.get(k, k)}" for k in keys}
        optimizers = [
            (f"{o}.param_groups", optimizer_state_entries(self.entries, o + "."))
            for o in meta.get("optimizer_names") or []
        ]
        saved = meta.get("optimizer_names") is not None
        unclaimed = unclaimed_keys(self.entries, f"{name}.", set(keys or ()))
        return Layout(self.version, model, aliases, optimizers, EXTRA_KEY, saved, unclaimed)

    def piece_meta(self, piece: StoredPiece) -> TensorStorageMetadata:
        """The stored tensor a piece in the other entries refers to; a damaged directory raises."""
        md = self.tensor_meta(piece.fqn)
        if md is None:
            raise CheckpointError(
                f"Sharded checkpoint {self.path} refers to {piece.fqn!r} but holds no such entry. HINT: the "
                "directory is damaged; use an earlier checkpoint. Nothing was loaded."
            )
        return md

    def with_whole_pieces(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """``extra`` (as :meth:`read_extra` gives it) with every stored piece read whole (on this process
        alone; see [Note: DCP-native layout])."""
        tensors: dict[str, torch.Tensor] = {}
        for _, piece in find_pieces(extra):
            md = self.piece_meta(piece)
            tensors[piece.fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        if tensors:
            self.read_objects([], tensors)
        return dict(fill_pieces(extra, tensors))

    def read_extra(self, layout: Layout | None = None) -> dict[str, Any]:
        """The checkpoint's entries other than model and optimizer state (on this process alone): flatshard's
        object entry, or the ``meta.pt`` file Lightning's strategies write; ``{}`` if there is neither."""
        key = (layout or self.layout()).extra_key
        if key is not None:
            extra = self.read_objects([key]).get(key)
            return dict(extra) if isinstance(extra, Mapping) else {}
        try:
            if isinstance(self.location, Remote):
                meta = self.location.child(LIGHTNING_META)
                if not meta.fs.exists(meta.path):
                    return {}
                with meta.fs.open(meta.path, "rb") as f:
                    data = io.BytesIO(f.read())
            else:
                if not (self.location / LIGHTNING_META).is_file():
                    return {}
                data = io.BytesIO((self.location / LIGHTNING_META).read_bytes())
            extra = torch.load(data, map_location="cpu", weights_only=False)
        except Exception as err:
            raise CheckpointError(
                f"Sharded checkpoint {self.path}: its {LIGHTNING_META} could not be read ({type(err).__name__}: "
                f"{err}). HINT: the directory is damaged; use an earlier checkpoint."
            ) from err
        return dict(extra) if isinstance(extra, Mapping) else {}

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

    def per_parameter_groups(self, root: str) -> bool:
        """Whether an optimizer's param groups are stored per parameter (torch's flattened layout)."""
        head = root + "."
        return root not in self.entries and any(
            k.startswith(head) and not k[len(head) :].partition(".")[0].isdigit() for k in self.entries
        )

    def param_groups(self, root: str) -> list[dict[str, Any]]:
        """An optimizer's param groups (on this process alone): one object entry ``root``, one entry per group
        and field under it (``<root>.<i>.<field>``), or one per parameter and field (``<root>.<name>.<field>``,
        torch's ``flatten_optimizer_state_dict``: then one group per parameter, which loading regroups like the
        optimizer's). Tensor fields are read whole."""
        if root in self.entries:
            return [dict(g) for g in self.read_objects([root])[root]]
        head = root + "."
        keys = [k for k in self.entries if k.startswith(head)]
        tensors = {}
        for k in keys:
            md = self.tensor_meta(k)
            if md is not None:
                tensors[k] = torch.empty(md.size, dtype=md.properties.dtype)
        values = self.read_objects([k for k in keys if k not in tensors], tensors)
        values.update(tensors)
        groups: dict[int, dict[str, Any]] = {}
        per_param: dict[str, dict[str, Any]] = {}
        for k in keys:
            rest = k[len(head) :]
            index, _, field_name = rest.partition(".")
            if index.isdigit():
                groups.setdefault(int(index), {})[field_name] = values[k]
            else:
                name, _, field_name = rest.rpartition(".")
                per_param.setdefault(name, {})[field_name] = values[k]
        one_each = [{**fields, "params": [name]} for name, fields in per_param.items()]
        return [groups[i] for i in sorted(groups)] + one_each

    def read_objects(
        self, keys: Sequence[str], tensors: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Read object entries (and whole ``tensors``, in place) on this process alone (no collective)."""
        targets: dict[str, Any] = {k: OBJECT for k in keys}
        targets.update(tensors or {})
        planner = _LoadPlanner(targets)
        reader = self._storage_reader()
        try:
            _dcp_load({k: _placeholder(v) for k, v in targets.items()}, reader, planner, no_dist=True)
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
