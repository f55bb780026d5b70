"""Byte ranges of a file read into caller-owned buffers: ``os.preadv`` for a local file, ``cat_ranges`` at a URL.

[Note: byte-range reads]
A read is planned from *pieces* (a tensor's name, an offset in the file, a writable byte buffer): sorted by
offset, pieces whose bytes follow each other in the file join one *chunk*, and no chunk holds more than
``CHUNK`` bytes (64 MiB) or ``IOV_MAX`` buffers; a larger piece is split across chunks. A local chunk is one
``os.preadv`` call that fills the buffers in place (a short count is continued, an end of file is an error):
no staging copy, whatever the size. At a URL, chunks are fetched in batches of at most ``CHUNK`` bytes with
the filesystem's ``cat_ranges`` (concurrent requests on object stores), then copied into their buffers, so the
staging memory stays bounded however much is read. Nothing is read that was not asked for: no gap between
pieces is ever filled in, so the bytes read are exactly the bytes asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.storage import Remote, storage_error

__all__ = [
    "CHUNK",
    "Chunk",
    "FileRef",
    "Piece",
    "byte_view",
    "fetch_small",
    "plan",
    "read_error",
    "read_local",
    "read_remote",
    "read_small",
]

CHUNK = 64 * 2**20  # the most bytes one read call fills, and the staging bound of one batch of URL reads
IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


@dataclass(frozen=True)
class FileRef:
    """A checkpoint file: where it is and its size when it was opened."""

    location: Path | Remote
    size: int

    def __str__(self) -> str:
        return str(self.location)


@dataclass
class Piece:
    """Bytes of one tensor to read: from ``offset`` in the file into ``dest``."""

    name: str
    offset: int
    dest: memoryview


@dataclass
class Chunk:
    """Consecutive bytes of one file, read by one call into the buffers ``parts`` (tensor name, buffer)."""

    file: FileRef
    offset: int
    parts: list[tuple[str, memoryview]] = field(default_factory=list)
    nbytes: int = 0

    def tensor_at(self, index: int) -> str:
        """The tensor whose bytes are at ``index`` bytes into this chunk."""
        for name, buf in self.parts:
            if index < len(buf):
                return name
            index -= len(buf)
        return self.parts[-1][0]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's elements (no copy)."""
    array: Any = tensor.detach().view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def plan(file: FileRef, pieces: list[Piece]) -> list[Chunk]:
    """``pieces`` as reads of ``file`` (see [Note: byte-range reads])."""
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for piece in sorted(pieces, key=lambda p: p.offset):
        offset, buf = piece.offset, piece.dest
        while len(buf):
            if (
                current is None
                or current.offset + current.nbytes != offset
                or current.nbytes >= CHUNK
                or len(current.parts) >= IOV_MAX
            ):
                current = Chunk(file, offset)
                chunks.append(current)
            take = min(len(buf), CHUNK - current.nbytes)
            current.parts.append((piece.name, buf[:take]))
            current.nbytes += take
            offset += take
            buf = buf[take:]
    return chunks


def read_local(fd: int, chunks: list[Chunk]) -> int:
    """Fill each chunk's buffers from the local file ``fd`` in place; the bytes read."""
    for chunk in chunks:
        buffers = [buf for _, buf in chunk.parts]
        offset, done = chunk.offset, 0
        while buffers:
            try:
                if hasattr(os, "preadv"):
                    n = os.preadv(fd, buffers, offset)
                else:  # platforms without preadv (older macOS)
                    os.lseek(fd, offset, os.SEEK_SET)
                    n = os.readv(fd, buffers)
            except OSError as err:
                raise read_error(chunk.file, chunk.tensor_at(done), err) from err
            if n == 0:
                raise _short_read(chunk, done)
            offset += n
            done += n
            while n and buffers:
                if n >= len(buffers[0]):
                    n -= len(buffers.pop(0))
                else:
                    buffers[0] = buffers[0][n:]
                    n = 0
    return sum(c.nbytes for c in chunks)


def read_remote(chunks: list[Chunk]) -> int:
    """Fetch the chunks of files at URLs (one filesystem) in batches staging at most ``CHUNK`` bytes, and copy
    each into its buffers; the bytes read."""
    batch: list[Chunk] = []
    staged = 0
    for chunk in chunks:
        if batch and staged + chunk.nbytes > CHUNK:
            _read_batch(batch)
            batch, staged = [], 0
        batch.append(chunk)
        staged += chunk.nbytes
    if batch:
        _read_batch(batch)
    return sum(c.nbytes for c in chunks)


def _read_batch(batch: list[Chunk]) -> None:
    results = _cat_ranges([(c.file, c.offset, c.offset + c.nbytes) for c in batch])
    for chunk, data in zip(batch, results):
        if isinstance(data, BaseException):
            raise read_error(chunk.file, chunk.tensor_at(0), data) from data
        if len(data) != chunk.nbytes:
            raise _short_read(chunk, len(data))
        view, pos = memoryview(data), 0
        for _, buf in chunk.parts:
            buf[:] = view[pos : pos + len(buf)]
            pos += len(buf)


def _cat_ranges(items: list[tuple[FileRef, int, int]]) -> list[Any]:
    """``cat_ranges`` on the files' filesystem: each range's bytes, or the exception that fetching it raised."""
    first = items[0][0].location
    if not isinstance(first, Remote):
        raise TypeError(f"{first} is a local file")
    paths = [f.location.path for f, _, _ in items if isinstance(f.location, Remote)]
    try:
        return list(
            first.fs.cat_ranges(paths, [s for _, s, _ in items], [e for _, _, e in items], on_error="return")
        )
    except Exception as err:  # a backend that raises instead of returning the error
        return [err] * len(items)


def read_error(file: FileRef, tensor: str, err: BaseException) -> CheckpointError:
    """The error for a read of ``tensor``'s bytes in ``file`` that failed."""
    if isinstance(file.location, Remote):
        return storage_error(file.location, err, f"read tensor {tensor!r}")
    return CheckpointError(
        f"Reading tensor {tensor!r} from {file} failed ({type(err).__name__}: {err}). HINT: check the disk and "
        "that the file is not being replaced; open the checkpoint again."
    )


def _short_read(chunk: Chunk, done: int) -> CheckpointError:
    return CheckpointError(
        f"Reading tensor {chunk.tensor_at(done)!r} from {chunk.file} failed: the file ends before byte "
        f"{chunk.offset + chunk.nbytes} (of bytes [{chunk.offset}, {chunk.offset + chunk.nbytes}) only {done} "
        f"could be read); it had {chunk.file.size} bytes when opened. HINT: the file shrank or was replaced "
        "while it was read; fetch it again and open it again."
    )


def read_small(location: Path | Remote, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a small object (an index, a magic number), in one read."""
    if isinstance(location, Path):
        try:
            with open(location, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        except OSError as err:
            raise CheckpointError(
                f"{location} could not be read ({err}). HINT: check that it is readable."
            ) from err
    try:
        return bytes(location.fs.cat_file(location.path, start=start, end=end))
    except Exception as err:
        raise storage_error(location, err, "read it") from err


def fetch_small(items: list[tuple[FileRef, int, int]], doing: str) -> list[bytes]:
    """Bytes ``[start, end)`` of each file at a URL, fetched together (the headers of a multi-file
    checkpoint)."""
    out: list[bytes] = [b""] * len(items)
    wanted = [i for i, (_, s, e) in enumerate(items) if e > s]
    if not wanted:
        return out
    for i, data in zip(wanted, _cat_ranges([items[i] for i in wanted])):
        location = items[i][0].location
        if isinstance(data, BaseException):
            if isinstance(location, Remote):
                raise storage_error(location, data, doing) from data
            raise data
        out[i] = bytes(data)
    return out
