"""Hugging Face's multi-file safetensors layout: the size limit, the split into files, and a writer that streams.

[Note: Hugging Face model directory]
``save_pretrained`` in transformers writes a model's weights as ``model.safetensors`` or, when they exceed
``max_shard_size``, as ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``:
``{"metadata": {"total_size": <bytes>}, "weight_map": {name: file}}``. Files are planned from the names, dtypes
and shapes alone, as huggingface_hub's ``split_torch_state_dict_into_shards`` plans them: tensors in state-dict
order fill a file until the next one would take it past the limit; a tensor larger than the limit gets a file of
its own, placed in the list as soon as it is met. So the plan is known before any data exists, and
:class:`PretrainedWriter` writes every file's header first and each tensor as it arrives, in any order: tensors
that arrive ahead of their place in a file wait until the ones before them are written (a file's tensors are laid
out in the order they will arrive, when the caller knows it, so nothing waits). Each file carries the metadata
transformers writes, ``{"format": "pt"}``.

Where it is written:

- a local directory: every file goes into a hidden directory beside it (``.NAME.flatshard-tmp``, see
  [Note: stale temporaries]) and is fsynced; only then does anything change at OUT_DIR. A new directory is that
  hidden one renamed. An existing one keeps the user's files (config, tokenizer, README); the previous export's
  index is removed first, the new files are renamed in, the index last, then the previous export's files the
  new one does not replace. A write that fails (a full disk) leaves OUT_DIR exactly as it was.
- a URL: every object is uploaded without being committed (where the filesystem can defer it, as object stores
  do), then the previous index is deleted, the objects committed under their final names, the index written
  last, and the previous export's other objects deleted. A failed upload discards what it uploaded and leaves
  the previous export as it was; a failure while committing removes the committed objects, leaving no index.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import torch

from flatshard.checkpoint import temporaries
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.files import fsync_dir
from flatshard.checkpoint.safetensors_format import CODES, encode_header
from flatshard.checkpoint.storage import METADATA, Location, Remote, children, remote_kind, storage_error

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FILE_METADATA",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "PlannedFile",
    "PretrainedWriter",
    "ShardPlan",
    "TensorSpec",
    "is_export_file",
    "parse_dtype",
    "parse_max_shard_size",
    "plan_shards",
]

WEIGHTS_NAME = "model.safetensors"  # the one file of an export that fits the limit
INDEX_NAME = "model.safetensors.index.json"
FILE_METADATA = MappingProxyType({"format": "pt"})  # what transformers writes into each file's header
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = MappingProxyType(
    {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
)
_SIZE = re.compile(r"^\s*(?P<value>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")
_CHUNK_BYTES = 16 * 2**20  # largest single write
_DTYPE_NAMES = MappingProxyType(
    {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float64": torch.float64,
        "fp64": torch.float64,
    }
)


def parse_max_shard_size(value: int | str) -> int:
    """The file size limit in bytes: an int, or a size as Hugging Face writes it (``"5GB"``, ``"500MB"``: powers
    of 1000; ``"5GiB"``, ``"100MiB"``: powers of 1024; ``"100KB"``; the unit's case does not matter).

    Raises ``ValueError`` naming the value for anything else (no unit, an unknown unit, zero or less).
    """
    hint = (
        "HINT: pass a number of bytes, or a size with a unit such as '5GB' or '500MB' (powers of 1000) or "
        "'5GiB' (powers of 1024); KB, MB, GB, TB and KiB, MiB, GiB, TiB are known."
    )
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"max_shard_size={value!r} is not a size. {hint}")
    if isinstance(value, int):
        size = value
    else:
        found = _SIZE.match(value)
        unit = (found["unit"].upper() or "B") if found else ""
        if found is None or unit not in _UNITS or (not found["unit"] and "." in found["value"]):
            raise ValueError(f"max_shard_size={value!r} is not a size. {hint}")  # bytes come whole
        size = int(float(found["value"]) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size={value!r} is not a positive size. {hint}")
    return size


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype floating tensors are cast to: a torch dtype, or its name (``"bfloat16"``, ``"bf16"``,
    ``"float16"``, ``"fp16"``, ``"float32"``, ...); ``None`` keeps each tensor's own. Raises ``ValueError``."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))
        if dtype is None:
            raise ValueError(
                f"dtype={value!r} is not a floating-point dtype flatshard exports to. HINT: pass one of "
                f"{', '.join(sorted(_DTYPE_NAMES))} (or a torch.dtype)."
            )
    if dtype is not None and (not dtype.is_floating_point or dtype not in CODES):
        raise ValueError(
            f"dtype={dtype} cannot be the dtype of an export. HINT: pass a floating-point dtype safetensors "
            "stores, such as torch.bfloat16, torch.float16 or torch.float32."
        )
    return dtype


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file this layout writes (and a later export replaces or removes)."""
    return name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_FILE.match(name) is not None


# ---------------------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name in the file, torch dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class PlannedFile:
    """One file of the layout and its tensors, in the order they are laid out in it."""

    name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ShardPlan:
    """The files of an export (see [Note: Hugging Face model directory])."""

    files: tuple[PlannedFile, ...]
    total_size: int  # the tensors' bytes, as the index's ``metadata.total_size``
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor name -> file, in state-dict order

    @property
    def is_sharded(self) -> bool:
        """Several files, hence an index."""
        return len(self.files) > 1

    def index(self) -> dict[str, Any] | None:
        """The index's content (``None`` for a single file, which has none)."""
        if not self.is_sharded:
            return None
        return {"metadata": {"total_size": self.total_size}, "weight_map": dict(self.weight_map)}


def plan_shards(
    tensors: Sequence[TensorSpec], max_shard_size: int | str, arrival: Mapping[str, int] | None = None
) -> ShardPlan:
    """Split ``tensors`` (in state-dict order) into files as huggingface_hub's
    ``split_torch_state_dict_into_shards`` splits a state dict of such tensors (each its own storage).

    Args:
        tensors: the tensors to write, each name once (tied names already removed).
        max_shard_size: the limit per file, as :func:`parse_max_shard_size` reads it.
        arrival: each name's position in the order the tensors will reach the writer; each file lays its tensors
            out in that order, so none has to wait (default: the order of ``tensors``).
    """
    limit = parse_max_shard_size(max_shard_size)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"plan_shards: the names {twice[:5]} appear more than once.")
    if not tensors:
        raise CheckpointError(
            "Nothing to write: the model has no tensors to export. HINT: check the module and the prefix."
        )
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    first_empty: TensorSpec | None = None
    empties: list[TensorSpec] = []
    for t in tensors:
        if t.nbytes == 0 and first_empty is not None:
            empties.append(t)  # huggingface_hub sees one storage in all empty tensors: they join the first
            continue
        first_empty = t if t.nbytes == 0 else first_empty
        if t.nbytes > limit:  # a file of its own, in the list at once (before the file being filled)
            groups.append([t])
            continue
        if size + t.nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        groups.append(current)
    if empties:
        next(g for g in groups if first_empty in g).extend(empties)
    order = {n: i for i, n in enumerate(names)} if arrival is None else arrival
    files = []
    for k, group in enumerate(groups):
        name = WEIGHTS_NAME if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        files.append(PlannedFile(name, tuple(sorted(group, key=lambda t: order[t.name]))))
    where = {t.name: f.name for f in files for t in f.tensors}
    return ShardPlan(tuple(files), sum(t.nbytes for t in tensors), {n: where[n] for n in names})


# ---------------------------------------------------------------------------------------------- writing
@dataclass
class _OpenFile:
    """A planned file being written: the next tensor due, those that arrived ahead of it, the open file."""

    plan: PlannedFile
    due: int = 0
    waiting: dict[str, torch.Tensor] = field(default_factory=dict)
    handle: IO[bytes] | None = None

    @property
    def done(self) -> bool:
        return self.due == len(self.plan.tensors)


class PretrainedWriter:
    """Writes a :class:`ShardPlan` into a directory or at a URL as the tensors arrive, in any order; see
    [Note: Hugging Face model directory].

    Call :meth:`write` for every planned tensor, then :meth:`finish`, which puts the export in place; or
    :meth:`abort`, which removes everything written (also on leaving a ``with`` block by an exception).
    Errors are :class:`CheckpointError` s naming the file and with a ``HINT:``.

    Args:
        location: the directory (a local path or a :class:`Remote`).
        plan: the files to write.
        metadata: each file's ``__metadata__`` (default ``{"format": "pt"}``).
        progress: called with the number of bytes of each write (default: nothing).
        index_metadata: more entries for the index's ``metadata`` (transformers adds ``total_parameters``).
    """

    def __init__(
        self,
        location: Location,
        plan: ShardPlan,
        metadata: Mapping[str, str] = FILE_METADATA,
        progress: Callable[[int], None] | None = None,
        index_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.location = location
        self.plan = plan
        self._index_metadata = dict(index_metadata or {})
        self._metadata = dict(metadata)
        self._progress = progress
        self._files = [_OpenFile(f) for f in plan.files]
        self._of = {t.name: (f, t) for f in self._files for t in f.plan.tensors}
        self._seen: set[str] = set()
        self._target: _Target = (
            _LocalTarget(location) if isinstance(location, Path) else _RemoteTarget(location)
        )

    def __enter__(self) -> PretrainedWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if err is not None:
            self.abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` under ``name`` now or, if tensors before it in its file have not arrived, once they
        have (it is kept until then)."""
        found = self._of.get(name)
        if found is None or name in self._seen:
            raise CheckpointError(
                f"{self.location}: the tensor {name!r} is {'written twice' if found else 'not in the plan'}. HINT: "
                "this is a bug in the caller of PretrainedWriter; nothing was put in place."
            )
        file, spec = found
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointError(
                f"{self.location}: {name!r} arrived as {tensor.dtype} {tuple(tensor.shape)}, planned as "
                f"{spec.dtype} {spec.shape}. HINT: the source changed while it was exported; export again."
            )
        self._seen.add(name)
        file.waiting[name] = tensor
        while not file.done and file.plan.tensors[file.due].name in file.waiting:
            self._write_due(file)

    def _write_due(self, file: _OpenFile) -> None:
        spec = file.plan.tensors[file.due]
        tensor = file.waiting.pop(spec.name)
        try:
            if file.handle is None:
                file.handle = self._target.open(file.plan.name)
                header = encode_header(
                    [(t.name, t.dtype, t.shape, t.nbytes) for t in file.plan.tensors], self._metadata
                )
                file.handle.write(header)
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, data.numel(), _CHUNK_BYTES):
                chunk = data[start : start + _CHUNK_BYTES]
                file.handle.write(chunk.numpy().data)
                if self._progress is not None:
                    self._progress(chunk.numel())
            file.due += 1
            if file.done:
                handle, file.handle = file.handle, None
                self._target.close(handle)
        except CheckpointError:
            raise
        except Exception as err:
            raise self._target.error(file.plan.name, err) from err

    def finish(self) -> Path | str:
        """Put the export in place (every planned tensor must have been written); returns the directory (the URL
        for a URL)."""
        missing = [t.name for f in self._files for t in f.plan.tensors[f.due :]]
        if missing:
            raise CheckpointError(
                f"{self.location}: {len(missing)} planned tensors never arrived ({missing[:5]}). HINT: this is a "
                "bug in the caller of PretrainedWriter; nothing was put in place."
            )
        index = self.plan.index()
        if index is not None:
            index["metadata"] = {**self._index_metadata, **index["metadata"]}
        text = None if index is None else (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        return self._target.commit([f.plan.name for f in self._files], text)

    def abort(self) -> None:
        """Remove what was written; never raises."""
        for f in self._files:
            f.waiting.clear()
            if f.handle is not None:
                with contextlib.suppress(Exception):
                    f.handle.close()
                f.handle = None
        with contextlib.suppress(Exception):
            self._target.discard()


class _Target:
    """Where the files go: opened and closed one at a time, put in place together."""

    def open(self, name: str) -> IO[bytes]:
        raise NotImplementedError

    def close(self, handle: IO[bytes]) -> None:
        raise NotImplementedError

    def commit(self, names: list[str], index: bytes | None) -> Path | str:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def error(self, name: str, err: BaseException) -> CheckpointError:
        raise NotImplementedError


def _refusal(where: object, what: str) -> CheckpointError:
    return CheckpointError(
        f"Cannot write a Hugging Face model directory at {where}: {what}. HINT: name a new directory or one that "
        "holds a model (config, tokenizer, an earlier export); nothing was written."
    )


class _LocalTarget(_Target):
    """A local directory, written through a hidden sibling (see [Note: Hugging Face model directory])."""

    def __init__(self, out: Path) -> None:
        if out.exists() and not out.is_dir():
            raise _refusal(out, "a file of that name exists")
        if (out / METADATA).exists():
            raise _refusal(out, "it is a sharded checkpoint directory")
        self.out = out
        # Beside OUT_DIR, so that renames put files in place; inside it if it is a mount point of its own.
        inside = out.is_dir() and out.stat().st_dev != out.absolute().parent.stat().st_dev
        try:
            self.stage = temporaries.create_hidden_directory(out / out.name if inside else out)
        except OSError as err:
            raise self.error(out.name, err) from err

    def open(self, name: str) -> IO[bytes]:
        return open(self.stage / name, "wb")

    def close(self, handle: IO[bytes]) -> None:
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()

    def commit(self, names: list[str], index: bytes | None) -> Path:
        try:
            if index is not None:
                with open(self.stage / INDEX_NAME, "wb") as f:
                    f.write(index)
                    f.flush()
                    os.fsync(f.fileno())
            (self.stage / temporaries.OWNER).unlink(missing_ok=True)
            fsync_dir(self.stage)
        except OSError as err:
            raise self.error(INDEX_NAME, err) from err
        try:
            if not self.out.exists():
                self.out.parent.mkdir(parents=True, exist_ok=True)
                os.rename(self.stage, self.out)
                fsync_dir(self.out.parent)
                return self.out
            new = {*names, *([INDEX_NAME] if index is not None else [])}
            stale = [n for n in os.listdir(self.out) if is_export_file(n) and n not in new]
            (self.out / INDEX_NAME).unlink(missing_ok=True)  # the previous export is no longer a model
            if index is not None:
                (self.out / WEIGHTS_NAME).unlink(missing_ok=True)  # it would shadow the new index
            for name in names:
                os.replace(self.stage / name, self.out / name)
            if index is not None:
                os.replace(self.stage / INDEX_NAME, self.out / INDEX_NAME)  # the export is complete
            for name in stale:
                (self.out / name).unlink(missing_ok=True)
            temporaries.remove(self.stage)
            fsync_dir(self.out)
        except OSError as err:
            raise CheckpointError(
                f"Could not put the export in place in {self.out}: {err.strerror or err}. Its previous model files "
                f"may be gone; its other files are kept. HINT: fix the cause (permissions) and export again."
            ) from err
        return self.out

    def discard(self) -> None:
        temporaries.remove(self.stage)

    def error(self, name: str, err: BaseException) -> CheckpointError:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
        return CheckpointError(
            f"Could not write {self.out / name}: {reason}. {self.out} is as it was before (nothing was put in "
            "place; the temporary files are removed). HINT: free space on that filesystem, or write somewhere else."
        )


class _RemoteTarget(_Target):
    """A URL: objects uploaded uncommitted, then committed (see [Note: Hugging Face model directory])."""

    def __init__(self, remote: Remote) -> None:
        kind = remote_kind(remote)
        if kind in ("sharded", "file"):
            raise _refusal(
                remote.url, "a sharded checkpoint" if kind == "sharded" else "an object of that name exists"
            )
        self.remote = remote
        self.pending: dict[str, Any] = {}  # uploaded, not committed
        self.placed: list[str] = []  # committed: removed if the export fails after all

    def open(self, name: str) -> IO[bytes]:
        # The filesystem's own opener: fs.open(autocommit=False) would also enlist the file in the filesystem's
        # shared transaction, which another save in this process (a background one) may commit.
        handle = self.remote.fs._open(self.remote.child(name).path, "wb", autocommit=False)
        if (
            getattr(handle, "autocommit", True) is not False
        ):  # this filesystem writes in place: remove on failure
            self.placed.append(name)
        self.pending[name] = handle
        return handle  # type: ignore[no-any-return]

    def close(self, handle: IO[bytes]) -> None:
        handle.close()  # uploaded; committed in commit()

    def commit(self, names: list[str], index: bytes | None) -> str:
        fs = self.remote.fs
        path = self.remote.child
        doing = "put the export in place"
        try:
            existing = children(self.remote)
            if INDEX_NAME in existing:
                fs.rm_file(path(INDEX_NAME).path)  # the previous export is no longer a model
            if index is not None and WEIGHTS_NAME in existing and WEIGHTS_NAME not in names:
                fs.rm_file(path(WEIGHTS_NAME).path)  # it would shadow the new index
            for name in names:
                handle = self.pending.pop(name)
                commit = getattr(handle, "commit", None)
                if commit is not None and getattr(handle, "autocommit", True) is False:
                    commit()
                    self.placed.append(name)
            if index is not None:
                doing = f"write {INDEX_NAME}"
                fs.pipe_file(path(INDEX_NAME).path, index)  # the export is complete
            doing = "remove the previous export's files"
            for name in existing:
                if is_export_file(name) and name not in names and name != INDEX_NAME:
                    fs.rm_file(path(name).path)
        except Exception as err:
            raise storage_error(self.remote, err, doing) from err
        finally:
            self.remote.refresh()
        self.placed.clear()
        return self.remote.url

    def discard(self) -> None:
        for handle in self.pending.values():
            with contextlib.suppress(Exception):
                handle.discard()
        self.pending.clear()
        for name in self.placed:
            with contextlib.suppress(Exception):
                self.remote.fs.rm_file(self.remote.child(name).path)
        self.placed.clear()
        self.remote.refresh()

    def error(self, name: str, err: BaseException) -> CheckpointError:
        return storage_error(self.remote.child(name), err, "write it")
