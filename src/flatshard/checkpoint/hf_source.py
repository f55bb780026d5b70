"""Hugging Face model checkpoints read by byte range: each rank of a sharded job reads only what it keeps.

[Note: reading a pretrained checkpoint by byte range]
:func:`open_source` takes a Hugging Face model directory (``model.safetensors``, or
``model.safetensors.index.json`` and the files it names, or ``pytorch_model.bin``, or
``pytorch_model.bin.index.json`` and its files; the first of these that exists, in that order, as
``from_pretrained`` chooses), or the path of one ``.safetensors`` / ``.bin`` file or of an index, local or at
any fsspec URL (see [Note: checkpoint storage]). Opening reads only headers: each ``.safetensors`` header with
two small reads (its 8-byte length, then the JSON), each ``.bin`` file's zip directory and pickle (no tensor
data). Everything that can be checked is checked then, before a byte of tensor data is read: that the files
exist, that the headers parse, that the data fits in each file (a truncated file), that every dtype is known,
that the index names only tensors its files hold, and that no tensor name is in two files.

:meth:`PretrainedSource.read` then fills caller-owned 1-D buffers with element ranges of flattened tensors:

- ``.safetensors``: a range of a tensor's elements is one byte range of its file (see
  [Note: safetensors format]). Requests whose bytes follow each other in the file become one read of at most
  64 MiB; a local file is read with ``os.preadv`` straight into the destination buffers, a file at a URL with
  the filesystem's ``cat_ranges`` in batches staging at most 64 MiB (see [Note: byte-range reads]).
  ``bytes_read`` grows by exactly the bytes requested.
- ``.bin``: a pickle inside a zip, whose tensors cannot be located without loading the pickle. A local file is
  loaded with ``torch.load(mmap=True, weights_only=True)``: one read-only mapping, only the pages under the
  requested elements are touched, and they are given back after each copy (see
  [Note: reading a full file by byte ranges]). At a URL the file must be downloaded whole, to a temporary file
  (deleted on :meth:`~PretrainedSource.close`) that is then mapped the same way; every process that reads it
  downloads it. One ``.bin`` file is mapped at a time. ``notes`` says so, for the user.

A read that fails (an I/O or storage error, a file that shrank since it was opened) raises
:class:`CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flatshard.checkpoint.byte_ranges import (
    Chunk,
    FileRef,
    Piece,
    byte_view,
    fetch_small,
    plan,
    read_error,
    read_local,
    read_remote,
    read_small,
)
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.mapped import MappedPages
from flatshard.checkpoint.safetensors_format import HeaderEntry, parse_header
from flatshard.checkpoint.storage import Remote, children, locate, storage_error

__all__ = ["PretrainedSource", "SourceTensor", "open_source"]

_ZIP_MAGIC = b"PK\x03\x04"  # a zip file's first bytes: torch.save's format since torch 1.6

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_CHOICES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)  # from_pretrained's order of preference
_BIN_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a pretrained checkpoint, as :func:`open_source` found it."""

    name: str  # the checkpoint's name
    file: str  # the file (path or URL) it lives in, for messages
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _SafetensorsFile:
    """A ``.safetensors`` file: its header's entries and, for a local file, an open descriptor."""

    def __init__(self, file: FileRef, entries: dict[str, HeaderEntry], fd: int | None) -> None:
        self.file = file
        self.entries = entries  # in the order of their bytes in the file
        self._fd = fd

    def shapes(self) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
        for name, entry in self.entries.items():
            yield name, entry.dtype, entry.shape

    def pieces(self, requests: Iterable[tuple[str, int, torch.Tensor]]) -> list[Piece]:
        out = []
        for name, first, dest in requests:
            entry = self.entries[name]
            size = dest.element_size()
            out.append(Piece(name, entry.begin + first * size, byte_view(dest)))
        return out

    def read_local(self, pieces: list[Piece]) -> int:
        """Read ``pieces`` from this local file straight into their buffers; the bytes read."""
        if self._fd is None:
            raise ValueError(f"{self.file} is closed")
        return read_local(self._fd, plan(self.file, pieces))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _BinFile:
    """A ``.bin`` file (``torch.save`` of a state dict): its tensors' dtypes and shapes, and once read, its
    mapping (see [Note: reading a pretrained checkpoint by byte range])."""

    def __init__(self, file: FileRef, meta: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.file = file
        self.meta = meta
        self._state: dict[str, torch.Tensor] | None = None
        self._pages: MappedPages | None = None
        self._local: Path | None = file.location if isinstance(file.location, Path) else None

    def shapes(self) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
        for name, (dtype, shape) in self.meta.items():
            yield name, dtype, shape

    @property
    def mapped(self) -> bool:
        return self._state is not None

    def read(self, requests: list[tuple[str, int, torch.Tensor]], scratch: _Scratch) -> int:
        """Copy each ``(name, first, out)`` from the mapping; the bytes fetched from the storage (a download)
        or, for a local file, the bytes copied."""
        fetched = 0
        if self._local is None:
            self._local = scratch.download(self.file)
            fetched = self.file.size
        state, pages = self._map(self._local)
        for name, first, out in requests:
            if out.numel() == 0:
                continue
            try:
                piece, mapped = _flat_range(state[name], first, out.numel())
                out.detach().view(torch.uint8).copy_(piece.view(torch.uint8))
            except (RuntimeError, OSError) as err:
                raise read_error(self.file, name, err) from err
            pages.release(mapped)
            if isinstance(self.file.location, Path):
                fetched += out.numel() * out.element_size()
        return fetched

    def _map(self, path: Path) -> tuple[dict[str, torch.Tensor], MappedPages]:
        # A mapped file that shrinks kills the process (SIGBUS) when a missing page is touched: check first.
        size = _local_size(path)
        if size != self.file.size:
            raise CheckpointError(
                f"{self.file} changed since it was opened: {size} bytes, {self.file.size} before. HINT: do not "
                "replace a checkpoint while it is read; open it again."
            )
        if self._state is None or self._pages is None:
            state = _load_bin(
                self.file, lambda: torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            )
            found = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
            if found != self.meta:
                raise CheckpointError(
                    f"{self.file} changed since it was opened: its tensors differ. HINT: do not replace a "
                    "checkpoint while it is read; open it again."
                )
            self._state, self._pages = state, MappedPages(path)
        return self._state, self._pages

    def unmap(self) -> None:
        self._state = None  # the last reference to the mapping's storage: unmapped now
        self._pages = None

    def close(self) -> None:
        self.unmap()


class _Scratch:
    """Temporary copies of ``.bin`` files read from a URL, deleted on close."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._count = 0

    def download(self, file: FileRef) -> Path:
        remote = file.location
        if not isinstance(remote, Remote):
            raise TypeError(f"{file} is a local file")
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="flatshard-pretrained-")
        self._count += 1
        local = Path(self._dir.name) / f"{self._count}-{remote.path.rsplit('/', 1)[-1]}"
        try:
            remote.fs.get_file(remote.path, str(local))
        except Exception as err:
            raise storage_error(remote, err, f"download it to {local}") from err
        return local

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


_Reader = _SafetensorsFile | _BinFile


class PretrainedSource:
    """An open pretrained checkpoint: its tensors, and reads of element ranges of them.

    A context manager; :meth:`close` releases its descriptors, mappings and temporary files. Built by
    :func:`open_source`.

    Attributes:
        location: what was opened, for messages.
        tensors: every tensor of the checkpoint by name, in file order (files in name order, the tensors of a
            file in the order of their bytes).
        bytes_read: tensor data fetched so far, headers excluded: for ``.safetensors`` exactly the bytes
            requested; for a local ``.bin`` the bytes copied out of its mapping (the pages touched are those
            bytes rounded out to whole pages); for a ``.bin`` at a URL each downloaded file's size.
        notes: what is worth telling the user about the cost of reading this checkpoint (a ``.bin`` format,
            a download, a choice between two layouts); empty for ``.safetensors``.
    """

    def __init__(self, location: str, readers: Sequence[_Reader], notes: list[str]) -> None:
        self.location = location
        self.notes = notes
        self.bytes_read = 0
        self.tensors: dict[str, SourceTensor] = {}
        self._readers = list(readers)
        self._reader_of: dict[str, _Reader] = {}
        self._scratch = _Scratch()
        self._closed = False
        for reader in self._readers:
            for name, dtype, shape in reader.shapes():
                self.tensors[name] = SourceTensor(name, str(reader.file), dtype, shape)
                self._reader_of[name] = reader

    def __enter__(self) -> PretrainedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PretrainedSource({self.location!r}, {len(self.tensors)} tensors in {len(self._readers)} files)"
        )

    def close(self) -> None:
        """Close the files, unmap the mapped ``.bin`` file and delete downloaded copies. Idempotent."""
        self._closed = True
        for reader in self._readers:
            reader.close()
        self._scratch.close()

    def read(self, requests: Sequence[tuple[SourceTensor, int, torch.Tensor]]) -> None:
        """For each ``(tensor, first, out)``: fill the 1-D contiguous CPU tensor ``out`` (of ``tensor.dtype``)
        with elements ``[first, first + out.numel())`` of the flattened ``tensor``.

        Every request is checked before anything is read (``ValueError`` for one that does not fit).
        Requests are grouped by file, in file order; see [Note: reading a pretrained checkpoint by byte range]
        for how each format is read. Raises :class:`CheckpointError` naming the file and tensor when a read
        fails; ``out`` buffers of that call may then be partly filled.
        """
        if self._closed:
            raise ValueError(
                f"{self.location} is closed. HINT: read inside the `with open_source(...)` block."
            )
        grouped: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        for tensor, first, out in requests:
            self._check(tensor, first, out)
            grouped.setdefault(id(self._reader_of[tensor.name]), []).append((tensor.name, first, out))
        remote: list[Chunk] = []
        for reader in self._readers:
            todo = grouped.get(id(reader))
            if not todo:
                continue
            if isinstance(reader, _BinFile):
                for other in self._readers:
                    if isinstance(other, _BinFile) and other is not reader and other.mapped:
                        other.unmap()  # one .bin file mapped at a time
                self.bytes_read += reader.read(todo, self._scratch)
            elif isinstance(reader.file.location, Remote):
                remote += plan(reader.file, reader.pieces(todo))
            else:
                self.bytes_read += reader.read_local(reader.pieces(todo))
        if remote:
            self.bytes_read += read_remote(remote)

    def _check(self, tensor: SourceTensor, first: int, out: torch.Tensor) -> None:
        if not isinstance(tensor, SourceTensor) or self.tensors.get(tensor.name) != tensor:
            raise ValueError(
                f"{tensor!r} is not a tensor of {self.location}. HINT: pass the SourceTensor objects of this "
                "source's `tensors`."
            )
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the buffer for {tensor.name!r} is a {type(out).__name__}, not a torch.Tensor")
        if out.device.type != "cpu" or out.dtype != tensor.dtype or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(
                f"the buffer for {tensor.name!r} is a {'contiguous' if out.is_contiguous() else 'non-contiguous'} "
                f"{out.dim()}-D {out.dtype} tensor on {out.device}; a contiguous 1-D {tensor.dtype} CPU tensor is "
                "needed. HINT: read into a CPU buffer of the checkpoint's dtype, then convert or move it."
            )
        if not isinstance(first, int) or first < 0 or first + out.numel() > tensor.numel:
            raise ValueError(
                f"elements [{first}, {first} + {out.numel()}) are not inside {tensor.name!r}, which has "
                f"{tensor.numel} elements (shape {list(tensor.shape)})"
            )


# ---------------------------------------------------------------------------------------------- opening
def open_source(source: str | os.PathLike[str]) -> PretrainedSource:
    """Open a Hugging Face checkpoint for reading by element range; only headers are read here.

    Args:
        source: a Hugging Face model directory, or the path of a ``.safetensors`` file, a ``.bin`` file
            (``torch.save`` of a state dict) or an index (``*.index.json``), local or an fsspec URL
            (``s3://``, ``memory://``, ``file://``, ...). In a directory, the first of ``model.safetensors``,
            ``model.safetensors.index.json``, ``pytorch_model.bin``, ``pytorch_model.bin.index.json`` is read.

    Raises :class:`CheckpointError` (naming the file and, where there is one, the tensor, with a ``HINT``) for
    a missing path or an unreachable URL, a directory without a checkpoint, an index naming a missing file or
    a tensor its file lacks, a tensor name in two files, a damaged or truncated file, or an unknown dtype.
    See [Note: reading a pretrained checkpoint by byte range].
    """
    location = locate(source)
    shown = str(location)
    notes: list[str] = []
    kind, size = _kind(location)
    if kind == "missing":
        raise CheckpointError(
            f"Pretrained checkpoint {shown} does not exist. HINT: pass a Hugging Face model directory (one "
            f"holding {SAFETENSORS} or {SAFETENSORS_INDEX}) or a .safetensors file; for a URL check it and the "
            "endpoint and credentials the fsspec backend reads."
        )
    if kind == "directory":
        listing = _listing(location)
        target = _child(location, _choose(shown, listing, notes))
        size = listing[_name(target)]
    else:
        target = location
    name = _name(target)
    weight_map: dict[str, str] | None = None
    if name.endswith(".json"):
        weight_map, files = _read_index(FileRef(target, size))
    elif name.endswith(".safetensors") or name.endswith(_BIN_SUFFIXES):
        files = [FileRef(target, size)]
    else:
        raise CheckpointError(
            f"Pretrained checkpoint {shown} is neither a .safetensors file, a .bin file nor an index "
            "(*.index.json). HINT: pass a Hugging Face model directory or one of those files."
        )
    readers = _open_files(files)
    try:
        _check_names(readers, weight_map, files, target)
    except CheckpointError:
        for reader in readers:
            reader.close()
        raise
    bins = [reader for reader in readers if isinstance(reader, _BinFile)]
    if bins:
        notes.append(_bin_note(shown, bins))
    return PretrainedSource(shown, readers, notes)


def _kind(location: Path | Remote) -> tuple[str, int]:
    """``("file", size)``, ``("directory", 0)`` or ``("missing", 0)``."""
    if isinstance(location, Path):
        if location.is_dir():
            return "directory", 0
        if location.is_file():
            return "file", location.stat().st_size
        return "missing", 0
    location.refresh()
    try:
        info = location.fs.info(location.path)
    except FileNotFoundError:
        return "missing", 0
    except Exception as err:
        raise storage_error(location, err, "reach it") from err
    if info.get("type") == "directory":
        return "directory", 0
    return "file", int(info.get("size") or 0)


def _listing(folder: Path | Remote) -> dict[str, int]:
    """The files in ``folder`` with their sizes; subfolders as ``name/`` with size -1."""
    if isinstance(folder, Path):
        out = {}
        for p in folder.iterdir():
            try:
                out[p.name + "/" if p.is_dir() else p.name] = -1 if p.is_dir() else p.stat().st_size
            except OSError:  # a dangling link: not there
                continue
        return out
    return {
        name + ("/" if info.get("type") == "directory" else ""): (
            -1 if info.get("type") == "directory" else int(info.get("size") or 0)
        )
        for name, info in children(folder).items()
    }


def _child(folder: Path | Remote, name: str) -> Path | Remote:
    return folder / name if isinstance(folder, Path) else folder.child(name)


def _parent(location: Path | Remote) -> Path | Remote:
    if isinstance(location, Path):
        return location.parent
    return Remote(location.url.rsplit("/", 1)[0], location.fs, location.path.rsplit("/", 1)[0])


def _name(location: Path | Remote) -> str:
    return location.name if isinstance(location, Path) else location.path.rsplit("/", 1)[-1]


def _choose(shown: str, listing: dict[str, int], notes: list[str]) -> str:
    present = [name for name in _CHOICES if name in listing]
    if not present:
        held = sorted(listing)
        files = [n for n in held if n.endswith((".safetensors", ".json", *_BIN_SUFFIXES))]
        hint = (
            f"pass the path of the checkpoint file or index to read, e.g. {shown}/{files[0]}"
            if files
            else "pass the directory that holds the model's weights (a subfolder?) or the weights file itself"
        )
        raise CheckpointError(
            f"Pretrained checkpoint {shown} is a directory without a Hugging Face checkpoint: none of "
            f"{', '.join(_CHOICES)} is there. It holds {len(held)} entries: {held[:20]}"
            f"{' ...' if len(held) > 20 else ''}. HINT: {hint}."
        )
    if len(present) > 1:
        notes.append(
            f"{shown} holds {', '.join(present)}; reading {present[0]} (the one transformers' from_pretrained "
            "prefers)."
        )
    return present[0]


def _read_index(index: FileRef) -> tuple[dict[str, str], list[FileRef]]:
    """The index's ``weight_map`` and the files it names (in name order), each checked to exist."""
    try:
        raw = read_small(index.location, 0, index.size)
        weight_map = json.loads(raw)["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"Index {index} is not a Hugging Face index ({type(err).__name__}: {err}): a JSON object with a "
            "'weight_map' of tensor names to file names is expected. HINT: download or copy it again, or pass "
            "the directory or one weights file instead."
        ) from err
    folder = _parent(index.location)
    listing = _listing(folder)
    files = []
    for file_name in sorted(set(weight_map.values())):
        if file_name not in listing or listing[file_name] < 0:
            tensor = next(k for k, v in weight_map.items() if v == file_name)
            raise CheckpointError(
                f"Index {index} names the file {file_name!r} (for {tensor!r} among others), which is not in "
                f"{folder} (it holds {sorted(listing)[:20]}). HINT: the download or copy is incomplete: fetch "
                "the missing file."
            )
        files.append(FileRef(_child(folder, file_name), listing[file_name]))
    return weight_map, files


def _open_files(files: list[FileRef]) -> list[_Reader]:
    """A reader per file, in order: every header parsed, every ``.bin`` file's pickle loaded (no data)."""
    headers = _headers([f for f in files if _name(f.location).endswith(".safetensors")])
    readers: list[_Reader] = []
    try:
        for file in files:
            if file.location in headers:
                file, entries, fd = headers.pop(file.location)
                readers.append(_SafetensorsFile(file, entries, fd))
            else:
                readers.append(_BinFile(file, _bin_meta(file)))
    except BaseException:
        for reader in readers:
            reader.close()
        for _, _, fd in headers.values():
            if fd is not None:
                os.close(fd)
        raise
    return readers


def _check_names(
    readers: list[_Reader], weight_map: dict[str, str] | None, files: list[FileRef], target: Path | Remote
) -> None:
    owner: dict[str, _Reader] = {}
    for reader in readers:
        for name, _, _ in reader.shapes():
            if name in owner:
                raise CheckpointError(
                    f"Tensor {name!r} is in both {owner[name].file} and {reader.file}. HINT: the checkpoint "
                    "mixes files of two saves; download or copy it again."
                )
            owner[name] = reader
    if weight_map is None:
        return
    by_name = {_name(f.location): r for f, r in zip(files, readers)}
    for name, file_name in weight_map.items():
        if owner.get(name) is not by_name[file_name]:
            elsewhere = f" (it is in {owner[name].file})" if name in owner else ""
            raise CheckpointError(
                f"Index {target} places tensor {name!r} in {by_name[file_name].file}, which does not hold it"
                f"{elsewhere}. HINT: the index and the weights files come from different saves; download or "
                "copy the checkpoint again."
            )


def _bin_note(shown: str, bins: list[_BinFile]) -> str:
    total = sum(b.file.size for b in bins)
    text = (
        f"{shown} is in PyTorch's .bin format ({len(bins)} file(s), {total / 2**30:.2f} GiB): a pickle in a zip, "
        "which cannot be read by byte range as .safetensors can. "
    )
    if isinstance(bins[0].file.location, Remote):
        return text + (
            f"At a URL each .bin file is downloaded whole to a temporary file (under {tempfile.gettempdir()}; "
            "set TMPDIR to move it) before its first read, by every process that reads it, then memory-mapped; "
            "the copies are deleted when the source is closed. Converting the checkpoint to .safetensors lets "
            "each process read only its bytes."
        )
    return text + (
        "Each file is memory-mapped when first read, one file at a time; only the pages under the requested "
        "elements are touched and they are given back after each copy (a non-contiguous tensor's rows are "
        "copied whole). Converting the checkpoint to .safetensors avoids loading the pickle."
    )


# --------------------------------------------------------------------------------------------- headers
def _headers(files: list[FileRef]) -> dict[Path | Remote, tuple[FileRef, dict[str, HeaderEntry], int | None]]:
    """Each ``.safetensors`` file (with its size as found), its entries in byte order and, for a local file,
    its open descriptor; by location."""
    out: dict[Path | Remote, tuple[FileRef, dict[str, HeaderEntry], int | None]] = {}
    remote = [f for f in files if isinstance(f.location, Remote)]
    try:
        for file in files:
            if isinstance(file.location, Path):
                out[file.location] = _local_header(file.location)
        if remote:
            prefixes = fetch_small([(f, 0, min(8, f.size)) for f in remote], "read its header")
            ends = [_header_end(p, f.size) for f, p in zip(remote, prefixes)]
            rests = fetch_small(
                [(f, len(p), end) for f, p, end in zip(remote, prefixes, ends)], "read its header"
            )
            for file, prefix, rest in zip(remote, prefixes, rests):
                out[file.location] = (file, _parse(prefix + rest, file), None)
    except BaseException:
        for _, _, fd in out.values():
            if fd is not None:
                os.close(fd)
        raise
    return out


def _local_header(path: Path) -> tuple[FileRef, dict[str, HeaderEntry], int]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise CheckpointError(
            f"{path} could not be opened ({err}). HINT: check that it exists and is readable."
        ) from err
    try:
        file = FileRef(path, os.fstat(fd).st_size)
        prefix = os.pread(fd, 8, 0)
        end = _header_end(prefix, file.size)
        raw = prefix + (os.pread(fd, end - len(prefix), len(prefix)) if end > len(prefix) else b"")
        return file, _parse(raw, file), fd
    except OSError as err:
        os.close(fd)
        raise CheckpointError(
            f"{path}: reading its header failed ({err}). HINT: check the disk and the file."
        ) from err
    except BaseException:
        os.close(fd)
        raise


def _header_end(prefix: bytes, size: int) -> int:
    """Where the header that ``prefix`` (the first 8 bytes) announces ends, or ``len(prefix)`` when it cannot
    fit in the file (so that :func:`_parse` reports what is wrong)."""
    if len(prefix) < 8:
        return len(prefix)
    end = 8 + int.from_bytes(prefix, "little")
    return end if end <= size else len(prefix)


def _parse(raw: bytes, file: FileRef) -> dict[str, HeaderEntry]:
    try:
        entries, _ = parse_header(raw, file.size, str(file))
    except ValueError as err:
        text = str(err)
        if "does not know" in text:
            hint = "convert that tensor to a dtype listed here (or use a newer flatshard that knows it)"
        elif "truncated" in text:
            hint = "the file is incomplete (an interrupted download or copy?): fetch it again and compare its size"
        else:
            hint = "the file is damaged or not a .safetensors file: fetch it again"
        raise CheckpointError(f"{text}. HINT: {hint}.") from err
    return dict(sorted(entries.items(), key=lambda kv: kv[1].begin))


def _bin_meta(file: FileRef) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtypes and shapes of a ``.bin`` file's tensors, from its zip directory and pickle: no tensor data
    is read (``map_location="meta"``)."""
    if read_small(file.location, 0, min(4, file.size)) != _ZIP_MAGIC:
        raise CheckpointError(
            f"{file} is not a zip-format torch.save file (an older torch.save format, or not PyTorch's at all), "
            "so it cannot be read lazily. HINT: convert it once with torch.save(torch.load(path, "
            "weights_only=True), path) on torch >= 1.6, or to .safetensors (safetensors.torch.save_file)."
        )
    location = file.location
    if isinstance(location, Path):
        state = _load_bin(
            file, lambda: torch.load(location, map_location="meta", mmap=True, weights_only=True)
        )
    else:

        def load() -> Any:
            with location.fs.open(location.path, "rb", block_size=2**20) as f:
                return torch.load(f, map_location="meta", weights_only=True)

        state = _load_bin(file, load)
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


def _load_bin(file: FileRef, load: Any) -> dict[str, torch.Tensor]:
    try:
        state = load()
    except Exception as err:
        raise CheckpointError(
            f"{file} could not be loaded as a torch.save state dict ({type(err).__name__}: {err}). It is "
            "truncated or damaged, or holds objects that weights_only=True refuses. HINT: fetch it again; a "
            "checkpoint that needs more than tensors can be converted to .safetensors where it is trusted."
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{file} holds a {type(state).__name__}, not a state dict of tensors. HINT: pass a Hugging Face "
            "pytorch_model.bin (a dict of tensor names to tensors)."
        )
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{file}: entry {name!r} is a {type(value).__name__}, not a tensor. HINT: pass a Hugging Face "
                "pytorch_model.bin (a dict of tensor names to tensors)."
            )
    return state


# -------------------------------------------------------------------------------------------- reading
def _flat_range(tensor: torch.Tensor, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements ``[first, first + n)`` of the flattened ``tensor`` as a contiguous 1-D tensor, and the part of
    ``tensor`` they were taken from (a view into its storage). A non-contiguous tensor's rows are copied."""
    if tensor.is_contiguous():
        piece = tensor.view(-1)[first : first + n]
        return piece, piece
    inner = tensor[0].numel() if tensor.dim() else 1
    lo, hi = first // inner, -(-(first + n) // inner)
    rows = tensor[lo:hi]
    start = first - lo * inner
    piece = rows.reshape(-1)[start : start + n]  # a view where the rows allow one: copy it (strides of 1)
    return piece.clone(memory_format=torch.contiguous_format), rows


# ---------------------------------------------------------------------------------------------- small I/O
def _local_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
