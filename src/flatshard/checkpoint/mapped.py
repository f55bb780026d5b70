"""Pages of a memory-mapped checkpoint file, given back once their bytes are copied out.

[Note: reading a full file by byte ranges]
A full checkpoint is loaded with ``torch.load(mmap=True)``: one private, read-only mapping of the file, each
tensor a view into it, nothing read yet. Each rank then copies only its own slices (its parameters' pieces,
its optimizer state's pieces) into its shards: only those pages are faulted in. A faulted file page stays
mapped, though, and counts in the process's resident memory until the mapping goes away at the end of the
load: a rank that keeps half of a file would still grow by half the file on top of what it keeps. So after
each copy the pages of its source are dropped from this process (``madvise(MADV_DONTNEED)`` on the range):
the file's bytes stay in the page cache, shared and reclaimable, and the rank's memory grows only by what it
keeps plus the pages of the one tensor being copied. The mapping is private and never written, so a
dropped page that is touched again (a neighbour sharing a page at a record's edge) is read back from the file
unchanged. Only addresses inside this file's mapping are ever given back (found in ``/proc/self/maps``);
elsewhere (another platform, a file read from a URL into memory) :meth:`MappedPages.release` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

import torch

__all__ = ["MappedPages"]

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


_LIBC = _libc()


class MappedPages:
    """The address ranges at which ``path`` is mapped in this process (after ``torch.load(mmap=True)``)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.released = 0  # bytes given back (for tests and benchmarks)
        if _LIBC is None or path is None:  # None: a file read into memory, not mapped
            return
        try:
            target = os.path.realpath(path)
            st = os.stat(target)
        except OSError:
            return
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5] != target:
                    continue
                inode = int(fields[4])
                if inode and inode != st.st_ino:  # another file of that name: not ours
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                self.ranges.append((lo, hi))

    def release(self, tensor: torch.Tensor) -> None:
        """Give back the pages under ``tensor``'s bytes, where they lie in this file's mapping."""
        if not self.ranges or tensor.device.type != "cpu" or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
        if tensor.is_contiguous():
            end = start + tensor.numel() * tensor.element_size()
        lo, hi = start - start % _PAGE, -(-end // _PAGE) * _PAGE
        for map_lo, map_hi in self.ranges:
            a, b = max(lo, map_lo), min(hi, map_hi)
            if a < b and _LIBC is not None and _LIBC.madvise(a, b - a, _MADV_DONTNEED) == 0:
                self.released += b - a
