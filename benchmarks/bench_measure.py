"""Measurement: ``/proc`` readers, peak RSS, the memory poller, ``malloc_trim``, tensor sizes, medians."""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from typing import Any

import torch

MIB = 1024 * 1024


# ----------------------------------------------------------------------------------------------------------
# Memory and time
# ----------------------------------------------------------------------------------------------------------


def proc_status_kib(*keys: str, path: str = "/proc/self/status") -> dict[str, int | None]:
    """``name: value kB`` lines of a /proc file (``None`` for a missing key or file)."""
    out: dict[str, int | None] = dict.fromkeys(keys)
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in out:
                    out[name] = int(rest.split()[0])
    except OSError:
        pass
    return out


def rss_kib() -> int:
    """This process's ``VmRSS`` (0 if unreadable)."""
    return proc_status_kib("VmRSS")["VmRSS"] or 0


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = proc_status_kib("VmHWM", "VmRSS")
    # Verify: right after a reset the high-water mark is (about) the current RSS.
    return st["VmHWM"] is not None and st["VmRSS"] is not None and st["VmHWM"] <= st["VmRSS"] + 1024


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def private_kib(pid: int | str = "self") -> int:
    """A process's private memory: ``RssAnon + RssFile`` of ``/proc/<pid>/status`` (its resident pages less
    ``RssShmem``, the shared-memory pages that other processes may map too); 0 if unreadable."""
    st = proc_status_kib("RssAnon", "RssFile", path=f"/proc/{pid}/status")
    return (st["RssAnon"] or 0) + (st["RssFile"] or 0)


def shmem_kib() -> int:
    """``Shmem`` of ``/proc/meminfo``: the host's shared-memory pages, each once however many processes map it."""
    return proc_status_kib("Shmem", path="/proc/meminfo")["Shmem"] or 0


def smaps_private_kib(pid: int | str = "self") -> int | None:
    """``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps_rollup``: exact, but tens of ms a read."""
    st = proc_status_kib("Private_Clean", "Private_Dirty", path=f"/proc/{pid}/smaps_rollup")
    return None if st["Private_Dirty"] is None else (st["Private_Clean"] or 0) + st["Private_Dirty"]


def touch_host_memory(n_mib: int) -> float:
    """Write one byte in every page of ``n_mib`` MiB of fresh memory, free it, return the seconds it took.
    On a VM whose host backs memory lazily, the next ``n_mib`` MiB any process allocates are then cheap
    to fault in, whatever ran before (see ``checkpoint.py``)."""
    t0 = time.perf_counter()
    block = mmap.mmap(-1, n_mib * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(block, dtype=torch.uint8)[:: mmap.PAGESIZE].fill_(1)  # the tensor dies here
    block.close()
    return time.perf_counter() - t0


class MemoryPoller:
    """Samples the private memory of ``pids`` (:func:`private_kib`) and the host's ``Shmem`` every ``interval``
    s on a thread, while in the context: per pid the value on entry and the peak, for the node the peak of
    ``sum of private + (Shmem - shmem_base_kib)`` (shared pages once). Spikes between samples can be missed.
    A sample ``pread`` s files opened once (~0.05 ms), not to steal the CPU it measures."""

    def __init__(self, pids: list[int], shmem_base_kib: int, interval: float = 0.005) -> None:
        self.pids = pids
        self.shmem_base_kib = shmem_base_kib
        self.interval = interval
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: list[int] = []

    @staticmethod
    def _field(data: bytes, key: bytes) -> int:
        i = data.find(key)
        return int(data[i + len(key) : data.index(b"kB", i)]) if i >= 0 else 0

    def _sample(self) -> None:
        *status, meminfo = (os.pread(fd, 8192, 0) for fd in self._fds)
        private = [self._field(d, b"RssAnon:") + self._field(d, b"RssFile:") for d in status]
        node = sum(private) + self._field(meminfo, b"\nShmem:") - self.shmem_base_kib
        self.peak_kib = [max(a, b) for a, b in zip(self.peak_kib, private)]
        self.node_peak_kib = max(self.node_peak_kib, node)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> MemoryPoller:
        paths = [f"/proc/{p}/status" for p in self.pids] + ["/proc/meminfo"]
        self._fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.before_kib = [private_kib(p) for p in self.pids]
        self.node_before_kib = sum(self.before_kib) + shmem_kib() - self.shmem_base_kib
        self.peak_kib = list(self.before_kib)
        self.node_peak_kib = self.node_before_kib
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def result(self) -> dict[str, Any]:
        return {
            "private_before_mib": [mib(k) for k in self.before_kib],
            "private_peak_mib": [mib(k) for k in self.peak_kib],
            "node_before_mib": mib(self.node_before_kib),
            "node_peak_mib": mib(self.node_peak_kib),
            "samples": self.samples,
        }


class PeakRSS:
    """Extra peak RSS of this process over a region: ``VmHWM`` after a reset, else a 5 ms RSS sampler."""

    def __init__(self, method: str) -> None:
        self.method = method  # "vmhwm" or "sampler"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._max_kib = 0
        self.base_kib = 0

    def __enter__(self) -> PeakRSS:
        if self.method == "vmhwm" and not reset_peak_rss():
            raise RuntimeError("resetting VmHWM via /proc/self/clear_refs stopped working")
        self.base_kib = rss_kib()
        if self.method == "sampler":
            self._max_kib = self.base_kib
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max_kib = max(self._max_kib, rss_kib())
            self._stop.wait(0.005)

    def __exit__(self, *exc: Any) -> None:
        if self.method == "sampler":
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self._max_kib = max(self._max_kib, rss_kib())
        else:
            self._max_kib = proc_status_kib("VmHWM")["VmHWM"] or 0
        self.rss_after_kib = rss_kib()

    @property
    def extra_mib(self) -> float:
        return round((self._max_kib - self.base_kib) / 1024, 1)

    @property
    def retained_mib(self) -> float:
        return round((self.rss_after_kib - self.base_kib) / 1024, 1)


def malloc_trim(enabled: bool = True) -> bool:
    """Give glibc's free heap memory back to the OS (``malloc_trim(0)``), so that the RSS before a gather is
    about the live memory and the gather's new allocations show up as RSS growth, instead of silently
    reusing what the model build, the training step or an earlier gather freed. False if unavailable."""
    if not enabled:
        return False
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def tensor_bytes(obj: Any) -> tuple[int, int, int]:
    """(bytes with each storage counted once, bytes summed over every tensor entry, number of entries)."""
    seen: set[tuple[int, int]] = set()
    unique = total = count = 0

    def walk(o: Any) -> None:
        nonlocal unique, total, count
        if isinstance(o, torch.Tensor):
            count += 1
            total += o.nbytes
            key = (o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                unique += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return unique, total, count
