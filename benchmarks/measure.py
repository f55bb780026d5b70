"""Measuring inside the ranks: ``/proc`` readers, peak RSS, the memory poller, the region probe."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import statistics
import threading
import time
from typing import Any

import torch

MIB = 1024 * 1024


def proc_kib(*keys: str, path: str = "/proc/self/status") -> dict[str, int | None]:
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


def rss_mib() -> float:
    return (proc_kib("VmRSS")["VmRSS"] or 0) / 1024


def hwm_mib() -> float:
    """``VmHWM``: the peak RSS since the process started or the last :func:`reset_peak_rss`."""
    return (proc_kib("VmHWM")["VmHWM"] or 0) / 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = proc_kib("VmHWM", "VmRSS")
    return st["VmHWM"] is not None and st["VmRSS"] is not None and st["VmHWM"] <= st["VmRSS"] + 1024


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cpu_s() -> float:
    """User + system CPU seconds of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def malloc_trim(enabled: bool = True) -> bool:
    """Give glibc's free heap back to the OS (``malloc_trim(0)``): an unusual condition, labelled where used."""
    if not enabled:
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def touch_host_memory(n_mib: int) -> float:
    """Write a byte in every page of ``n_mib`` fresh MiB and free them; returns the seconds it took. On a VM
    whose host backs memory lazily, the next ``n_mib`` MiB any process allocates are then cheap to fault in,
    so contenders that run one after another all start alike (an unusual condition, labelled where used)."""
    t0 = time.perf_counter()
    block = mmap.mmap(-1, n_mib * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(block, dtype=torch.uint8)[:: mmap.PAGESIZE].fill_(1)
    block.close()
    return time.perf_counter() - t0


def shmem_kib() -> int:
    """``Shmem`` of ``/proc/meminfo``: shared-memory pages, each once however many processes map it."""
    return proc_kib("Shmem", path="/proc/meminfo")["Shmem"] or 0


def shared_pages_counted_twice_mib() -> float:
    """Shared-memory pages RSS counts in full here though other ranks map them too (``RssShmem - Pss_Shmem``)."""
    rss = proc_kib("RssShmem")["RssShmem"] or 0
    pss = proc_kib("Pss_Shmem", path="/proc/self/smaps_rollup")["Pss_Shmem"]
    return (rss - (rss if pss is None else pss)) / 1024


class MemoryPoller:
    """Every ``interval`` s, on a thread: the private memory (``RssAnon + RssFile``) of each pid and the node's
    total (their sum + the growth of ``Shmem`` since ``shmem_base_kib``: shared pages once). Reports the values
    on entry and the peaks; spikes between samples can be missed. Files are opened once and ``pread``."""

    def __init__(self, pids: list[int], shmem_base_kib: int, interval: float = 0.005) -> None:
        self.pids, self.shmem_base_kib, self.interval = pids, shmem_base_kib, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: list[int] = []

    @staticmethod
    def _field(data: bytes, key: bytes) -> int:
        i = data.find(key)
        return int(data[i + len(key) : data.index(b"kB", i)]) if i >= 0 else 0

    def _sample(self) -> tuple[list[int], int]:
        *status, meminfo = (os.pread(fd, 8192, 0) for fd in self._fds)
        private = [self._field(d, b"RssAnon:") + self._field(d, b"RssFile:") for d in status]
        return private, sum(private) + self._field(meminfo, b"\nShmem:") - self.shmem_base_kib

    def _update(self) -> None:
        private, node = self._sample()
        self.peak = [max(a, b) for a, b in zip(self.peak, private)]
        self.node_peak = max(self.node_peak, node)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._update()

    def __enter__(self) -> MemoryPoller:
        self._fds = [os.open(f"/proc/{p}/status", os.O_RDONLY) for p in self.pids]
        self._fds.append(os.open("/proc/meminfo", os.O_RDONLY))
        self.before, self.node_before = self._sample()
        self.peak, self.node_peak = list(self.before), self.node_before
        self._thread = threading.Thread(target=self._run, name="memory-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()
        for fd in self._fds:
            os.close(fd)

    def result(self) -> dict[str, Any]:
        return {
            "private_before_mib": [round(k / 1024, 1) for k in self.before],
            "private_peak_mib": [round(k / 1024, 1) for k in self.peak],
            "node_before_mib": round(self.node_before / 1024, 1),
            "node_peak_mib": round(self.node_peak / 1024, 1),
        }


class Probe:
    """One region of this process: wall and CPU seconds, peak RSS growth (``VmHWM`` reset on entry, minus the
    RSS then), the peaks of anonymous and of file-backed pages sampled apart (a mapped checkpoint's pages are
    file pages), and the bytes read (``/proc/self/io``: ``rchar``, and ``read_bytes`` from the disk)."""

    KEYS = ("RssAnon", "RssFile")

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._stop = threading.Event()

    def _split(self) -> list[int]:
        st = proc_kib(*self.KEYS)
        return [st[k] or 0 for k in self.KEYS]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = [max(a, b) for a, b in zip(self._peak, self._split())]

    def __enter__(self) -> Probe:
        self.hwm_reset = reset_peak_rss()
        self._base_mib, self._io, self._cpu = rss_mib(), _io(), cpu_s()
        self._base = self._peak = self._split()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self._peak = [max(a, b) for a, b in zip(self._peak, self._split())]
        io = _io()
        self.result = {
            "s": elapsed,
            "cpu_s": cpu_s() - self._cpu,
            "base_mib": round(self._base_mib, 1),
            "peak_growth_mib": round(hwm_mib() - self._base_mib, 1),
            "retained_mib": round(rss_mib() - self._base_mib, 1),
            "anon_peak_growth_mib": round((self._peak[0] - self._base[0]) / 1024, 1),
            "file_peak_growth_mib": round((self._peak[1] - self._base[1]) / 1024, 1),
            "rchar": io.get("rchar", 0) - self._io.get("rchar", 0),
            "read_bytes": io.get("read_bytes", 0) - self._io.get("read_bytes", 0),
        }


def _io() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = int(v)
    except OSError:
        pass
    return out
