"""What a CPU rank holds besides its tensors, measured in fresh processes: the runtime line of the estimate.

[Note: a rank's runtime]
The dry run measures live tensor storage (see [Note: what the memory tracker measures]). The operating system
sees more in a CPU rank's resident set: the interpreter, torch's and flatshard's code and data, the model's own
imports (transformers, say), the process group, flatshard's shared-memory channel, what the first training step
loads (autograd's and the optimizer's code, the engine's threads), and the C allocator's free memory that it keeps:
glibc serves blocks below its mmap threshold from its heaps and keeps them when they are freed, and the threshold
rises to the largest block freed (up to 32 MiB), so a step's activations and gradients leave heap memory behind
that no tensor holds. None of it is a constant: it depends on the machine, the versions, the model's imports and
its sizes. So it is measured, in processes started like the ranks:

1. ``min(2, N)`` fresh interpreters (``python -c``, see :func:`main`) import torch and flatshard, form a gloo
   process group, shard a model of three 4 MiB units on CPU and train it for two steps (its reduce-scatters
   fill both slots of the shared-memory channel). The first then imports the target and builds its model on the
   meta device (the model's imports; what building any model on the meta device loads, meta kernels and their
   Python decompositions, is loaded and left out first, since a rank that builds its model on CPU never loads
   it). Each part is the growth of ``VmRSS`` over the part before, read after the small model is freed and the
   heap trimmed (as ``shard()`` leaves it).
2. Each of them then replays each dry run's logged step (:attr:`StorageTracker.allocations`) on real
   memory, in a forked copy of itself: it builds the model's parameters and frees them (a rank that builds its
   model on CPU and shards it leaves the allocator so), then runs the step three times, each allocation as the
   step made it (the engine's flat blocks through its own transport, each a mapping, the rest through the C
   allocator), every page written once, freed where the step freed it. What the copy's peak RSS grows beyond
   the replay's own live bytes is the allocator's part. Where the blocks land depends on the heap's state,
   which differs from process to process, and so does the result (measured on the 2-core VM of
   ``docs/benchmarks.md``: from 70 to 145 MiB for one GPT-2 step; two ranks of one run peaked up to 100 MiB
   apart).
   So each replays eight times, with 0 to 448 KiB held at the heap's start, and the largest of all counts: the
   busiest rank.

From the engine's known sizes: a channel maps one segment per rank of its group (a hybrid layout has one channel
per group); the measurement's touched bytes per segment times the row's segments is the channel's part, so a
single rank has none. The ranks are taken to be on one host. Not counted: objects of a training loop beyond the
model (a Trainer's loggers and callbacks, data loaders and their workers), and scratch memory inside an operator.
A replay that would not fit in half of this machine's available memory (with the other rank's) is skipped (a
note says so).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["PARTS", "Replay", "Runtime", "factory_path", "main", "measure_runtime", "replay"]

# The runtime's parts, in the order a rank pays them.
PARTS = (
    "interpreter, torch and flatshard",
    "model imports",
    "process group",
    "first step",
    "shared-memory channel",
    "allocator",
)

_PASSES = 3  # steps replayed: the allocator's free memory settles after the first few
_SHIFTS = tuple(k << 16 for k in range(8))  # 0 to 448 KiB: see [Note: a rank's runtime]
_PAGE = 4096
_WARMUP_FEATURES = 1024  # a 1024 x 1024 fp32 unit: 4 MiB, both 2 MiB slots of the channel
_TIMEOUT_S = 600.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Runtime:
    """The runtime measured once for an estimate (see [Note: a rank's runtime]).

    ``base`` holds the parts paid before a step (bytes, largest rank), ``channel_segment`` the bytes one mapped
    segment of the shared-memory channel had touched, ``segments`` how many the measuring rank mapped,
    ``allocator`` one entry per replayed log (``None``: not replayed).
    """

    base: dict[str, int]
    channel_segment: int
    segments: int
    processes: int
    allocator: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def parts(self, segments: int, log: int | None) -> dict[str, int]:
        """The parts for a rank that maps ``segments`` channel segments, with the allocator of log ``log``."""
        out = dict(self.base)
        out["shared-memory channel"] = self.channel_segment * segments
        allocator = self.allocator[log] if log is not None and log < len(self.allocator) else None
        out["allocator"] = allocator or 0
        return {k: out.get(k, 0) for k in PARTS}


def factory_path(target: str | Callable[[], Any]) -> str | None:
    """``"module:qualname"`` a fresh interpreter can import the factory by, or ``None`` (``__main__``, a local or
    lambda function, an object without a module)."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    owner: Any = sys.modules.get(module)
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    return f"{module}:{qualname}" if owner is target else None


def _status(*keys: str) -> dict[str, int]:
    """``/proc/self/status`` fields in bytes (0 where missing)."""
    out = dict.fromkeys(keys, 0)
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in out:
                out[name] = int(rest.split()[0]) * 1024
    return out


def _available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _die_with_parent() -> None:
    """Linux: this process is killed when the one that started it ends, so a measurement leaves nobody behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def live_peak(log: Sequence[Sequence[Any]]) -> int:
    """The most bytes a log holds at once."""
    sizes: dict[int, int] = {}
    now = peak = 0
    for key, nbytes, _ in log:
        now -= sizes.pop(key, 0)
        if nbytes >= 0:
            sizes[key] = nbytes
            now += nbytes
            peak = max(peak, now)
    return peak


def replay(
    build: Sequence[int],
    log: Sequence[Sequence[Any]],
    mapped: Callable[[int], Any],
    passes: int = _PASSES,
    shift: int = 0,
) -> int:
    """Build the model's parameters (``build``: their sizes) and free them, as a rank that builds its model on CPU
    and shards it does (the C allocator's thresholds follow the blocks it freed), then replay a logged step
    ``passes`` times on real memory; returns how far this process's peak RSS grew beyond the log's live bytes (0
    at least). ``mapped(nbytes)`` allocates an engine block."""
    import torch

    pad = torch.empty(shift, dtype=torch.uint8).fill_(1)  # held: where the blocks land starts shifted
    params = [torch.empty(n, dtype=torch.uint8)[::_PAGE].fill_(1) for n in build]
    del params
    _trim()  # as shard() leaves the heap (see [Note: returning the replaced parameters])
    start = _status("VmRSS")["VmRSS"]
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS from here, where the system allows it
    live: dict[int, Any] = {}
    for _ in range(passes):
        for key, nbytes, is_mapped in log:
            live.pop(key, None)
            if nbytes >= 0:
                t = mapped(nbytes) if is_mapped else torch.empty(nbytes, dtype=torch.uint8)
                t[::_PAGE].fill_(1)  # an operator writes what it allocates: every page is touched
                live[key] = t
        live.clear()
    del pad
    grown = _status("VmHWM")["VmHWM"] - start
    return max(0, grown - live_peak(log))


def _replay_forked(
    build: Sequence[int], log: Sequence[Sequence[Any]], mapped: Callable[[int], Any], shift: int
) -> int:
    """:func:`replay` in a forked copy of this process, so each log starts from the same allocator state."""
    if not hasattr(os, "fork"):
        return replay(build, log, mapped, shift=shift)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: report and leave without running any of the parent's exit handlers
        code = 1
        try:
            os.close(read)
            _die_with_parent()
            os.write(write, str(replay(build, log, mapped, shift=shift)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise RuntimeError(f"the allocator replay (pid {pid}) exited with status {status}")
    return int(data)


def _largest(*values: int | None) -> int | None:
    """The largest of the measured values (``None`` where none was measured)."""
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def _trim() -> None:
    """glibc's ``malloc_trim(0)``; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _rss() -> int:
    return _status("VmRSS")["VmRSS"]


def _load_meta_machinery(nn: Any) -> None:
    """Build a small model on the meta device, so that what building any model there loads (meta kernels, their
    Python decompositions: about 30 MiB that a rank building its model on CPU never loads) is not counted as the
    model's imports."""
    import torch

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Conv1d(8, 8, 1))
    del model


def _rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One measuring rank (see [Note: a rank's runtime]); ``flatshard`` and torch are imported by the caller."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from flatshard.engine import shard, unit_states

    base: dict[str, int] = {"interpreter, torch and flatshard": spec["start_rss"]}
    torch.set_num_threads(1)  # as launchers start CPU ranks (torchrun: OMP_NUM_THREADS=1)
    now = _rss()
    rank, world = spec["rank"], spec["processes"]
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(spec["store"], world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=_TIMEOUT_S),
    )
    try:
        base["process group"] = _rss() - now
        now += base["process group"]
        f = _WARMUP_FEATURES
        model = nn.Sequential(*(nn.Linear(f, f, bias=False) for _ in range(3)))
        shard(model, device=torch.device("cpu"), auto_wrap_policy={nn.Linear})
        transport = next(h.transport for s in unit_states(model) for h in s.handles)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(torch.ones(4, f)).sum().backward()
            opt.step()
        del model, opt
        _trim()  # as shard() leaves the heap (see [Note: returning the replaced parameters])
        status = _status("VmRSS", "RssShmem")
        shmem = status["RssShmem"]
        base["first step"] = status["VmRSS"] - now - shmem
        dist.barrier()
    finally:
        dist.destroy_process_group()
    base["model imports"] = 0
    if spec["target"]:  # rank 0 only: the other measures the process group and the first step alone
        from flatshard.estimator.target import build, resolve_factory

        _load_meta_machinery(nn)
        now = _rss()
        built = build(resolve_factory(spec["target"]), spec["target"])
        del built
        base["model imports"] = _rss() - now
    out: dict[str, Any] = {"base": base, "shmem": shmem, "allocator": [], "notes": []}
    for entry in spec["logs"]:
        need = max(live_peak(entry["step"]), sum(entry["build"]))
        if 2 * world * need > _available():  # every measuring rank replays at once
            out["allocator"].append(None)
            out["notes"].append(
                f"the allocator was not measured: replaying the step needs {need / 2**20:.0f} MiB, more than half "
                "of this machine's available memory"
            )
            continue
        samples = [
            _replay_forked(
                entry["build"], entry["step"], lambda n: transport.empty_flat(n, torch.uint8), shift
            )
            for shift in _SHIFTS
        ]
        out["allocator"].append(max(samples))
    return out


def main() -> None:
    """A measuring rank's entry (``python -c``): ``argv[1]`` is its spec file, the result goes to ``argv[2]``."""
    start_rss = _rss()  # torch and flatshard are imported by the bootstrap before this module runs
    _die_with_parent()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if os.getppid() != spec["parent"]:
        sys.exit(1)  # the estimate that started it is gone
    spec["start_rss"] = start_rss
    result = _rank(spec)
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])


_BOOTSTRAP = "import torch, flatshard; from flatshard.estimator.runtime import main; main()"


class Replay(NamedTuple):
    """What the allocator's part replays: the model's parameter sizes (built, then freed), one logged step."""

    build: list[int]
    step: list[tuple[int, int, bool]]


def measure_runtime(
    target: str | None, processes: int, logs: Sequence[Replay], timeout: float = _TIMEOUT_S
) -> Runtime:
    """Measure a rank's runtime in ``processes`` fresh ranks (1 or 2), each replaying ``logs``.

    ``target`` is the factory's import path (``None``: the model's imports are not measured). Raises
    ``RuntimeError`` naming the rank and its error output when a rank fails or ``timeout`` passes; every
    process it started is gone when it returns.
    """
    env = dict(os.environ)
    path = [p if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory(prefix="flatshard-runtime-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        errs = []
        timed_out = False
        try:
            for rank in range(processes):
                spec = {
                    "target": target if rank == 0 else None,
                    "rank": rank,
                    "processes": processes,
                    "store": os.path.join(tmp, "store"),
                    "parent": os.getpid(),
                    "logs": [{"build": r.build, "step": r.step} for r in logs],
                }
                spec_path = os.path.join(tmp, f"spec{rank}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                err = open(os.path.join(tmp, f"err{rank}.txt"), "wb")  # closed below
                errs.append(err)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BOOTSTRAP, spec_path, os.path.join(tmp, f"out{rank}.json")],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                )
            deadline = time.monotonic() + timeout
            # until all are done, one fails (its peer would wait for it in the process group), or time is up
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for err in errs:
                err.close()
        results: dict[int, dict[str, Any]] = {}
        for rank, p in sorted(enumerate(procs), key=lambda rp: rp[1].returncode == -signal.SIGKILL):
            out = os.path.join(tmp, f"out{rank}.json")  # a rank that failed is named before one killed here
            if p.returncode != 0 or not os.path.exists(out):
                with open(os.path.join(tmp, f"err{rank}.txt"), errors="replace") as f:
                    tail = f.read()[-2000:]
                why = f"timed out after {timeout:.0f} s" if timed_out else f"exited with {p.returncode}"
                raise RuntimeError(f"measuring rank {rank} of {processes} {why}:\n{tail}")
            with open(out) as f:
                results[rank] = json.load(f)
    base = dict(results[0]["base"])  # the first rank's: the other's are alike but for the model's imports
    shmem = max(r["shmem"] for r in results.values())
    segments = processes if processes > 1 else 0
    return Runtime(
        base=base,
        channel_segment=shmem // segments if segments else 0,
        segments=segments,
        processes=processes,
        allocator=[_largest(*samples) for samples in zip(*(r["allocator"] for r in results.values()))],
        notes=results[0]["notes"],
    )
