"""Allocation of the large, short-lived CPU buffers of a training step (gathered parameters, flat gradients).

[Note: huge pages for CPU buffers]
Every step a sharded model allocates and frees, per unit, a gathered flat parameter (twice under
FULL_SHARD), an unsharded flat gradient and a gradient shard. On Linux such blocks are above glibc's
``mmap`` threshold, so each allocation is a fresh mapping that the kernel fills one 4 KiB page fault
at a time; on a 203M-parameter model that is ~1.4M faults per rank per step, and kernel time exceeds
compute time. Asking for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on the fresh block, before
anything touches it, makes each fault bring in 2 MiB: 512x fewer faults, measured at about half the
step time on that model (``docs/benchmarks.md``). It is a hint: peak memory does not change, and where
the kernel has huge pages disabled (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``never``), on other
systems, or for CUDA tensors it does nothing. ``FLATSHARD_CPU_HUGEPAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

__all__ = ["advise_hugepages", "empty_flat"]

_MADV_HUGEPAGE = 14  # linux/mman.h
_PAGE = 4096
_MIN_BYTES = 4 << 20  # below two huge pages there is nothing to gain


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` when huge pages can be requested on this system, else ``None``."""
    if not sys.platform.startswith("linux") or os.environ.get("FLATSHARD_CPU_HUGEPAGES", "1") == "0":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return None
    if "[madvise]" not in mode and "[always]" not in mode:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_hugepages(t: torch.Tensor) -> None:
    """Ask for huge pages backing ``t``'s storage; call it before the storage is first written."""
    if t.device.type != "cpu":
        return
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes < _MIN_BYTES:
        return
    fn = _madvise()
    if fn is None:
        return
    start = storage.data_ptr() & ~(_PAGE - 1)  # the page holding the first byte: same mapping
    end = storage.data_ptr() + nbytes
    fn(start, end - start, _MADV_HUGEPAGE)  # a hint: a failure leaves ordinary pages


def empty_flat(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel)`` with huge pages requested for large CPU blocks."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_hugepages(t)
    return t
