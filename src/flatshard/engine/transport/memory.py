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
systems, or for CUDA tensors it does nothing (setting that file to ``never`` is how to turn it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
import threading

import torch

__all__ = [
    "FreedBlocks",
    "Prefaulter",
    "advise_hugepages",
    "alloc_storage",
    "empty_flat",
    "empty_mapped",
    "free_storage",
    "libc",
    "trim_heap",
]

_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux >= 5.14
_PAGE = 4096
_MIN_BYTES = 4 << 20  # below two huge pages there is nothing to gain


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library on Linux, loaded once with ``errno`` kept (foreign calls release the GIL), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def _libc_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` on Linux, else ``None``."""
    c = libc()
    if c is None:
        return None
    fn = c.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` when huge pages can be requested on this system, else ``None``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return None
    if "[madvise]" not in mode and "[always]" not in mode:
        return None
    return _libc_madvise()


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; elsewhere nothing).

    [Note: returning the replaced parameters]
    ``shard()`` replaces each parameter's data with its piece of a shard and frees the full tensor. Tensors of
    a model built or cast in place (``model.to(torch.bfloat16)`` frees the fp32 originals, which raises glibc's
    mmap threshold, so the bf16 copies come from the heap) live in the C heap, and a freed heap block stays
    with the process: measured on a 204M-parameter GPT cast to bf16, 2 ranks, each rank held 285 MiB more
    after ``shard()`` than after trimming, more than its whole bf16 shard gained. ``shard()`` therefore trims
    the heap once when it is done (a few milliseconds), so the memory of the replaced parameters is returned
    in the user's own sequence, not only after a ``gc``/``malloc_trim`` a user would not run.
    """
    c = libc()
    trim = getattr(c, "malloc_trim", None) if c is not None else None
    if trim is not None:
        trim(0)


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
    """``torch.empty(numel)``; a large CPU block is a mapping of its own, with huge pages requested."""
    t = (
        empty_mapped((numel,), dtype)
        if device.type == "cpu"
        else torch.empty(numel, dtype=dtype, device=device)
    )
    advise_hugepages(t)
    return t


_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _mappable(nbytes: int) -> bool:
    """Whether a CPU block of ``nbytes`` gets a mapping of its own (Linux, large blocks)."""
    return nbytes >= _MIN_BYTES and sys.platform.startswith("linux")


class FreedBlocks:
    """Gathered-parameter blocks freed in this pass, kept for the next gather of the same size.

    [Note: reusing freed blocks]
    A fresh mapping costs far more than the copy that fills it: the kernel zeroes every page on first touch.
    Measured on the 2-core VM of ``docs/benchmarks.md``, gathering 100 MB into a fresh mapping took 26-31 ms,
    into one already touched 5 ms. A step gathers every unit once or twice, and the units of a model are
    mostly one size, so :func:`free_storage` keeps the last ``capacity`` blocks it freed and
    :func:`alloc_storage` takes one of exactly the size it needs. A kept block stands in for the block the
    very next gather would map: in a pass through the units (free one, gather the next) no more memory is
    in use at any moment than without keeping, as long as the next large allocation is that gather. Between
    passes it is not: the runtime empties the pool (:meth:`clear`) after the last unit of a forward (by the
    recorded execution order; after every untracked forward), when a root's forward returns and at the end of
    backward, so the head and loss computed after the last unit, the optimizer step and everything between
    steps find the memory returned. The pool belongs to the root's transport (see [Note: the transport
    interface]) and goes with it; ``capacity=0`` keeps nothing.
    """

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self._blocks: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()
        self.reused = 0  # blocks taken from the pool (for tests and benchmarks)

    def give(self, block: torch.UntypedStorage) -> None:
        if self.capacity < 1:
            return  # dropped by the caller: unmapped
        with self._lock:
            self._blocks.append(block)
            del self._blocks[: -self.capacity]  # the oldest beyond capacity are unmapped

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        with self._lock:
            for i in range(len(self._blocks) - 1, -1, -1):
                if self._blocks[i].nbytes() == nbytes:
                    self.reused += 1
                    return self._blocks.pop(i)
        return None

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


def alloc_storage(t: torch.Tensor, kept: FreedBlocks | None = None) -> None:
    """Give ``t`` (whose storage was freed with :func:`free_storage`) storage for all its elements again.

    A large CPU block gets a mapping of its own (one just freed, if ``kept`` holds one of that size: see
    [Note: reusing freed blocks]), swapped into the existing storage object, so every view of it (as autograd
    saved them) uses the new memory and :func:`free_storage` can unmap it.
    """
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() == nbytes:
        return
    if t.device.type == "cpu" and _CAN_SWAP and _mappable(nbytes) and storage.nbytes() == 0:
        block = kept.take(nbytes) if kept is not None else None
        if block is not None:
            storage._swap_data_ptr_(block)  # type: ignore[attr-defined]
            return
        fresh = empty_mapped((nbytes,), torch.uint8)
        storage._swap_data_ptr_(fresh.untyped_storage())  # type: ignore[attr-defined]
    else:
        storage.resize_(nbytes)
    advise_hugepages(t)


def free_storage(t: torch.Tensor, kept: FreedBlocks | None = None) -> None:
    """Release ``t``'s storage, keeping the storage object (views saved by autograd keep pointing at it); a
    mapped block goes to ``kept`` for the next gather of its size, or is unmapped."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return
    if not storage.resizable():  # a mapping put there by alloc_storage
        empty = torch.UntypedStorage(0, device=t.device)
        storage._swap_data_ptr_(empty)  # type: ignore[attr-defined]
        if kept is not None:
            kept.give(empty)  # now the mapping: kept for the next gather, or unmapped when dropped
        del empty
        return
    storage.resize_(0)


def empty_mapped(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a private anonymous mapping of its own (large blocks only).

    Unlike an allocation that glibc may carve from recycled heap memory or map, it is always fresh,
    page-aligned memory that :class:`Prefaulter` can back in one call, and it is unmapped as soon as the
    tensor is freed. Its storage is not shared with any other tensor.
    """
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * dtype.itemsize
    if not _mappable(nbytes):
        return torch.empty(shape, dtype=dtype)
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(block, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class Prefaulter:
    """Faults in the pages of fresh, large CPU tensors on a helper thread, in the order they were added.

    [Note: prefaulting outputs]
    A full state dict is gigabytes of freshly allocated memory on the ranks that keep it, and the kernel
    backs it one page fault at a time on first write: on the machines measured in ``docs/benchmarks.md``
    that costs more than copying the data in. ``madvise(MADV_POPULATE_WRITE)`` backs a whole range in one
    call, without the per-page traps, and releases the GIL, so a helper thread populates the outputs
    ahead of the copies that fill them. Whichever touches a page first faults it; the contents never
    change, so nothing waits on the thread. Linux >= 5.14 only (elsewhere it does nothing).

    The outputs deliberately get ordinary pages, not huge pages (see [Note: huge pages for CPU buffers]):
    measured on the VM of ``docs/benchmarks.md``, backing 2.3 GB with 4 KiB pages right after the process
    freed as much took ~1.0 s, with 2 MiB pages 1.8-4.3 s, because a 2 MiB allocation takes whole free
    blocks, which are the ones the VM has handed back to its host, where 4 KiB pages reuse memory just
    freed. A first gather in a process whose memory the host has not backed yet (about 5x a warm fault
    per page there) costs the same either way; the threads spread it over the cores.
    """

    _PIECE = 32 << 20  # madvise granularity: the unit of work of a thread, and how long close() waits

    def __init__(self, threads: int = 2) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(
                f"Prefaulter(threads={threads!r}): the number of helper threads must be an int >= 1. HINT: leave "
                "it at its default (2)."
            )
        self._tensors: list[torch.Tensor] = []
        self._pieces: list[tuple[int, int]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._count = threads
        self._fn = _populate()

    def add(self, t: torch.Tensor) -> None:
        if self._fn is None or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        if storage.nbytes() < _MIN_BYTES:
            return
        self._tensors.append(t)  # alive until close(): its pages are never someone else's
        start = -(-storage.data_ptr() // _PAGE) * _PAGE
        end = (storage.data_ptr() + storage.nbytes()) // _PAGE * _PAGE
        for a in range(start, end, self._PIECE):
            self._pieces.append((a, min(self._PIECE, end - a)))

    def start(self) -> Prefaulter:
        if self._pieces and not self._threads:
            for i in range(min(self._count, len(self._pieces))):
                thread = threading.Thread(target=self._run, name=f"flatshard-prefault-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._tensors = []
        self._pieces = []

    def __enter__(self) -> Prefaulter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        fn = self._fn
        assert fn is not None
        while not self._stop.is_set():
            with self._lock:  # pieces in order, so the threads stay ahead of the copies
                if self._next >= len(self._pieces):
                    return
                start, n = self._pieces[self._next]
                self._next += 1
            fn(start, n, _MADV_POPULATE_WRITE)  # a failure leaves the pages to the copies' faults


@functools.cache
def _populate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` when this kernel backs pages with ``MADV_POPULATE_WRITE`` (Linux >= 5.14, probed once
    on a page of its own), else ``None``."""
    fn = _libc_madvise()
    if fn is None:
        return None
    block = mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(block)
    ok = fn(ctypes.addressof(view), _PAGE, _MADV_POPULATE_WRITE) == 0
    del view  # the buffer's export: the mapping closes once it is gone
    block.close()
    return fn if ok else None
