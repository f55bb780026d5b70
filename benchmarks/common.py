"""What the benchmark scripts share: the model, the rank helpers, measurement, machine info and output.

* **The model**: the GPT of ``examples/gpt/model.py`` (``GPT``, ``GPTConfig``, ``Block``), loaded from its
  file under the fixed module name ``GPT_MODULE_NAME`` (see :func:`_load_gpt_module`), the presets of
  ``step_time.py`` (``PRESETS``, also used by the other scripts), :func:`build_model` (identical init on
  every rank and for every contender) and :func:`make_batches` (the same token batches for everyone).
* **The contenders** of ``step_time.py`` (flatshard, FSDP1, FSDP2, DDP), which ``memory.py`` builds the
  same way: :func:`wrap_contender`, ``CONTENDER_DESCRIPTIONS``.
* **Ranks**: :func:`spawn_ranks` (fresh processes and a fresh process group per call, through
  ``flatshard.testing.spawn``) and :func:`barrier`.
* **Checkpoints** (``checkpoint.py``): :class:`PeakRSS`, :func:`malloc_trim`, :func:`tensor_bytes`, fault logs,
  :func:`check_correctness` of saved states, :func:`touch_host_memory` (same host memory for every contender).
* **Measurement**: ``/proc`` readers (:func:`proc_status_kib`, :func:`rss_kib`, :func:`private_kib`,
  :func:`shmem_kib`, :func:`smaps_private_kib`), :func:`reset_peak_rss` (``VmHWM``), :class:`MemoryPoller`
  (private memory of several processes and of the node, sampled), :func:`mib`, :func:`median`.
* **Machine info** (:func:`machine_info`) and **output**: :func:`utc_now`, :func:`default_out`
  (``docs/bench/...``), :func:`write_json`, :func:`pyplot` and :func:`save_figure`, :func:`fmt` and
  :func:`indent` for the printed tables.

The scripts are run as ``python benchmarks/<script>.py``: Python puts ``benchmarks/`` first on ``sys.path``,
so ``import common`` works there, and ranks started with the ``spawn`` method get the parent's ``sys.path``
(multiprocessing's preparation data) and import the script, hence this module, the same way. Nothing here
edits ``sys.path``. As in the scripts this came from, flatshard is imported inside the functions that use it.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
import mmap
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
GPT_MODEL_PATH = REPO / "examples" / "gpt" / "model.py"
# The name the example GPT's module is registered under in ``sys.modules``: its classes pickle by it, and a
# spawned rank registers the same module under the same name when it imports this one.
GPT_MODULE_NAME = "flatshard_benchmarks_gpt_model"
MIB = 1024 * 1024


# ----------------------------------------------------------------------------------------------------------
# The model: examples/gpt/model.py, its presets, the batches
# ----------------------------------------------------------------------------------------------------------


def _load_gpt_module() -> ModuleType:
    """``examples/gpt/model.py`` as the module ``GPT_MODULE_NAME``, loaded from its path (no ``sys.path``
    edit; the file stays where the example uses it). It is registered in ``sys.modules`` before it runs, as
    an import would do: ``dataclasses`` looks the module up while building ``GPTConfig``, and pickle finds
    the classes through it."""
    module = sys.modules.get(GPT_MODULE_NAME)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(GPT_MODULE_NAME, GPT_MODEL_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example GPT from {GPT_MODEL_PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[GPT_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[GPT_MODULE_NAME]
        raise
    return module


gpt_model = _load_gpt_module()
GPT = gpt_model.GPT
GPTConfig = gpt_model.GPTConfig
Block = gpt_model.Block

PRESETS: dict[str, dict[str, Any]] = {
    # vocab 8192 rather than GPT-2's 50257 keeps the small preset dominated by the transformer blocks.
    "cpu-small": dict(
        d_model=512, n_layer=8, n_head=8, batch_size=8, seq_len=128, vocab_size=8192, device="cpu"
    ),
    "cpu-large": dict(
        d_model=1024, n_layer=12, n_head=16, batch_size=1, seq_len=64, vocab_size=50257, device="cpu"
    ),
    "cuda-1b": dict(
        d_model=2048, n_layer=18, n_head=16, batch_size=4, seq_len=1024, vocab_size=50257, device="cuda"
    ),
}
MODEL_FIELDS = ("d_model", "n_layer", "n_head", "batch_size", "seq_len", "vocab_size")


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(cfg["seed"])  # identical init on every rank and for every contender
    config = GPTConfig(
        vocab_size=cfg["vocab_size"],
        block_size=cfg["seq_len"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        d_model=cfg["d_model"],
        dropout=0.0,
        tie_weights=True,
        bias=True,
    )
    return GPT(config)


def make_batches(cfg: dict[str, Any], rank: int, world_size: int, device: torch.device) -> list[Any]:
    """One global batch per step from a fixed seed; this rank takes its slice (same for all contenders)."""
    n = cfg["warmup"] + cfg["steps"]
    b = cfg["batch_size"]
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 1000 + step)
        tokens = torch.randint(0, cfg["vocab_size"], (b * world_size, cfg["seq_len"] + 1), generator=g)
        mine = tokens[rank * b : (rank + 1) * b]
        out.append((mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)))
    return out


def local_numel(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor -> this rank's shard
        total += local.numel()
    return total


# ----------------------------------------------------------------------------------------------------------
# The contenders of step_time.py (memory.py builds its peers the same way)
# ----------------------------------------------------------------------------------------------------------

FLATSHARD_CONTENDERS = ("flatshard", "flatshard_grad_op", "flatshard_compiled", "flatshard_root_resharded")
CONTENDER_DESCRIPTIONS = {
    "flatshard": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}",
    "flatshard_grad_op": "flatshard.shard SHARD_GRAD_OP, auto_wrap_policy={Block}",
    "flatshard_compiled": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, each Block compiled in place"
    " (compile_units: torch.compile, the config's compile_kwargs)",
    "flatshard_root_resharded": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, "
    "reshard_root_after_forward=True (the root resharded after forward, as the fsdp2 contender's)",
    "fsdp1": "torch FSDP1 FULL_SHARD, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp1_grad_op": "torch FSDP1 SHARD_GRAD_OP, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp2": "torch FSDP2 fully_shard per Block then root (reshard_after_forward=True)",
    "fsdp2_grad_op": "torch FSDP2 fully_shard per Block then root, reshard_after_forward=False",
    "ddp": "torch DistributedDataParallel (full replica per rank)",
}


def _mp_dtypes(cfg: dict[str, Any]) -> tuple[torch.dtype, torch.dtype]:
    return torch.bfloat16, getattr(torch, cfg["reduce_dtype"])


def _wrap_flatshard(
    model: torch.nn.Module, cfg: dict[str, Any], device: torch.device, strategy: str, info: dict[str, Any]
) -> torch.nn.Module:
    """Shard with flatshard. Options this flatshard does not implement yet (``NotImplementedError``) are
    dropped one at a time when they were asked for in ``auto`` mode (or are the bf16 mixed precision):
    first the one the error message names, else mixed precision, forward prefetch, backward prefetch."""
    import flatshard

    bwd = cfg["flatshard_backward_prefetch"]
    fwd = cfg["flatshard_forward_prefetch"]
    opts: dict[str, Any] = {
        "mixed_precision": None,
        "forward_prefetch": fwd in ("on", "auto"),
        "backward_prefetch": {"auto": "BACKWARD_PRE", "none": None}.get(bwd, bwd),
    }
    extra = {"reshard_root_after_forward": True} if cfg.get("contender") == "flatshard_root_resharded" else {}
    defaults: dict[str, Any] = {"mixed_precision": None, "forward_prefetch": False, "backward_prefetch": None}
    droppable = []
    if cfg["precision"] == "bf16-mixed":
        param_dtype, reduce_dtype = _mp_dtypes(cfg)
        opts["mixed_precision"] = flatshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        droppable.append("mixed_precision")  # then flatshard runs in fp32, and the output says so
    if fwd == "auto":
        droppable.append("forward_prefetch")
    if bwd == "auto":
        droppable.append("backward_prefetch")
    fallbacks: list[str] = []
    shapes = [p.shape for p in model.parameters()]
    while True:
        touched = [p.shape for p in model.parameters()] != shapes or any(
            flatshard.is_sharded(m) for m in model.modules()
        )
        if touched:  # a failed shard() changed the module: rebuild it from the seed
            model = build_model(cfg)
        try:
            flatshard.shard(
                model,
                sharding_strategy=strategy,
                auto_wrap_policy={Block},
                limit_all_gathers=True,
                device=device,
                **opts,
                **extra,
            )
            break
        except NotImplementedError as err:
            candidates = [k for k in droppable if opts[k] != defaults[k]]
            if not candidates:
                raise
            named = [k for k in candidates if k in str(err)]
            drop = (named or candidates)[0]
            fallbacks.append(
                f"{drop}={opts[drop]!r} -> {defaults[drop]!r} (NotImplementedError: {str(err).splitlines()[0]})"
            )
            opts[drop] = defaults[drop]
    info["flatshard_options"] = {
        "backward_prefetch": opts["backward_prefetch"],
        "forward_prefetch": opts["forward_prefetch"],
        "mixed_precision": None if opts["mixed_precision"] is None else repr(opts["mixed_precision"]),
        "limit_all_gathers": True,
        **extra,
        "requested": {"backward_prefetch": bwd, "forward_prefetch": fwd, "precision": cfg["precision"]},
        "fallbacks": fallbacks,
    }
    if cfg["precision"] == "bf16-mixed" and opts["mixed_precision"] is None:
        info["precision_used"] = "fp32 (flatshard mixed precision not available: see fallbacks)"
    return model


def wrap_contender(
    name: str, model: torch.nn.Module, cfg: dict[str, Any], rank: int, device: torch.device, info: dict
) -> torch.nn.Module:
    """Shard or replicate ``model`` as the contender ``name`` of ``step_time.py`` (one unit per ``Block``)."""
    mixed = cfg["precision"] == "bf16-mixed"
    if name in FLATSHARD_CONTENDERS:
        strategy = "SHARD_GRAD_OP" if name == "flatshard_grad_op" else "FULL_SHARD"
        model = _wrap_flatshard(model, {**cfg, "contender": name}, device, strategy, info)
        if name == "flatshard_compiled":  # what FlatShardStrategy(compile=...) does after sharding
            from flatshard.engine import compile_units

            kwargs = dict(cfg.get("compile_kwargs") or {})
            info["compiled_units"] = len(compile_units(model, kwargs))
            info["compile_kwargs"] = {k: str(v) for k, v in kwargs.items()}
        return model
    if name in ("fsdp1", "fsdp1_grad_op"):
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = None
        if mixed:
            param_dtype, reduce_dtype = _mp_dtypes(cfg)
            mp = FSDPMixedPrecision(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype
            )
        # By default FSDP1 prefetches in forward exactly when flatshard is asked to (like for like);
        # --fsdp1-forward-prefetch off keeps FSDP1 at its own default instead.
        fwd_prefetch = (
            cfg["flatshard_forward_prefetch"] in ("on", "auto")
            and cfg.get("fsdp1_forward_prefetch", "same") != "off"
        )
        info["fsdp1_options"] = {
            "backward_prefetch": "BACKWARD_PRE (FSDP1 default)",
            "forward_prefetch": fwd_prefetch,
            "limit_all_gathers": True,
            "device_id": str(device),
        }
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.FULL_SHARD
            if name == "fsdp1"
            else ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            # torch 2.13 refuses device_id=None for a CPU module ("FSDP needs a non-CPU accelerator
            # device"); an explicit CPU device selects FSDP1's CPU/gloo path.
            device_id=device,
            mixed_precision=mp,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=fwd_prefetch,
            limit_all_gathers=True,
        )
    if name in ("fsdp2", "fsdp2_grad_op"):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": name == "fsdp2"}
        if mixed:
            param_dtype, reduce_dtype = _mp_dtypes(cfg)
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if device.type == "cuda":
            return DistributedDataParallel(model.to(device), device_ids=[device.index])
        return DistributedDataParallel(model)
    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------------------------------------
# Ranks and process groups
# ----------------------------------------------------------------------------------------------------------


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str, timeout: float
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with a fresh process group
    (``flatshard.testing.spawn``); returns the per-rank results."""
    from flatshard.testing import spawn

    return spawn(fn, world_size, *args, backend=backend, timeout=timeout)


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:  # gloo: ranks may share a GPU, and device_ids is an NCCL notion
            dist.barrier()
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


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


def fault_log_path(cfg: dict[str, Any], name: str, rank: int) -> Path:
    """Where a rank of contender ``name`` has ``faulthandler`` write (under ``cfg["tmpdir"]``)."""
    return Path(cfg["tmpdir"]) / f"fault_{name}_{cfg.get('fsdp1_offload', '')}_rank{rank}.log"


def crash_report(cfg: dict[str, Any], name: str, world_size: int) -> str:
    """What faulthandler wrote for a rank that died hard: the fatal error and the innermost frame."""
    lines = []
    for rank in range(world_size):
        path = fault_log_path(cfg, name, rank)
        text = path.read_text().strip().splitlines() if path.exists() else []
        fatal = [ln for ln in text if ln.startswith("Fatal Python error")]
        if fatal:
            frames = [ln.strip() for ln in text if ln.strip().startswith("File ")]
            lines.append(f"rank {rank}: {fatal[0]}" + (f" at {frames[0]}" if frames else ""))
    return "; ".join(lines)


def reference_param_names(cfg: dict[str, Any]) -> list[str]:
    """``named_parameters()`` of the unsharded GPT, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return [n for n, _ in model.named_parameters()]


def model_state_equal(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
    """Same keys and torch.equal tensors; returns (equal, the keys that differ)."""
    if set(a) != set(b):
        return False, sorted(set(a) ^ set(b))[:10]
    bad = []
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            if v.shape != w.shape or v.dtype != w.dtype or not torch.equal(v, w):
                bad.append(k)
        elif v != w:
            bad.append(k)
    return not bad, bad


def optim_entry_equal(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None or set(a) != set(b):
        return False
    return all(
        torch.equal(torch.as_tensor(a[k]).float(), torch.as_tensor(b[k]).float())
        if isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor)
        else a[k] == b[k]
        for k in a
    )


def optim_by_name(name: str, osd: dict[str, Any], param_names: list[str]) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed by parameter name. flatshard numbers parameters in ``param_groups`` order
    (= ``model.named_parameters()`` order, the optimizer was built from ``model.parameters()``); FSDP1 and
    FSDP2 already key it by FQN."""
    state = osd["state"]
    if name == "flatshard":
        ids = [i for g in osd["param_groups"] for i in g["params"]]
        return {param_names[pos]: state[i] for pos, i in enumerate(ids) if i in state}
    return {str(k): v for k, v in state.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_correctness(
    contenders: list[str], tmpdir: Path, param_names: list[str], reference_names: list[str]
) -> dict[str, Any]:
    """Compare every contender's saved state with the first one's (flatshard when it ran)."""
    files = {c: tmpdir / f"{c}.pt" for c in contenders if (tmpdir / f"{c}.pt").exists()}
    out: dict[str, Any] = {
        "reference": None,
        "compared": list(files),
        "param_order_matches_unsharded_model": param_names == reference_names,
    }
    if len(files) < 2:
        out["note"] = "fewer than two contenders saved a state: nothing to compare"
        out["all_equal"] = None
        return out
    loaded = {c: torch.load(p, map_location="cpu", mmap=True) for c, p in files.items()}
    ref = next(iter(loaded))
    out["reference"] = ref
    ref_opt = optim_by_name(ref, loaded[ref]["optim"], param_names)
    out["optimizer_state_names_match_parameters"] = set(ref_opt) == set(param_names)
    all_equal = True
    pairs: dict[str, Any] = {}
    for c in loaded:
        if c == ref:
            continue
        model_eq, bad_keys = model_state_equal(loaded[ref]["model"], loaded[c]["model"])
        opt_c = optim_by_name(c, loaded[c]["optim"], param_names)
        entry: dict[str, Any] = {
            "model_same_keys": set(loaded[ref]["model"]) == set(loaded[c]["model"]),
            "model_tensors_equal": model_eq,
            "model_keys_differing": bad_keys,
            "optim_same_param_names": set(ref_opt) == set(opt_c),
        }
        max_diff: dict[str, float | None] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            differing = []
            worst = 0.0
            for pname, st in ref_opt.items():
                a, b = st.get(key), opt_c.get(pname, {}).get(key)
                if a is None or b is None or a.shape != b.shape:
                    differing.append(pname)
                    worst = float("nan")
                elif not torch.equal(a, b):
                    differing.append(pname)
                    worst = max(worst, max_abs_diff(a, b) or 0.0)
            entry[f"{key}_equal"] = not differing and entry["optim_same_param_names"]
            entry[f"{key}_params_differing"] = differing[:10]
            max_diff[key] = worst
        steps = {float(torch.as_tensor(st["step"]).item()) for st in [*ref_opt.values(), *opt_c.values()]}
        entry["step_values"] = sorted(steps)
        if not model_eq:
            max_diff["model"] = max(
                (max_abs_diff(loaded[ref]["model"][k], loaded[c]["model"][k]) or 0.0)
                for k in bad_keys
                if k in loaded[c]["model"] and k in loaded[ref]["model"]
            )
        entry["max_abs_diff"] = max_diff
        entry["equal"] = entry["model_same_keys"] and model_eq and entry["exp_avg_equal"]
        all_equal = all_equal and entry["equal"]
        pairs[f"{ref}_vs_{c}"] = entry
    out["pairs"] = pairs
    out["all_equal"] = all_equal  # model keys + tensors and AdamW exp_avg, bitwise
    del loaded
    return out


# ----------------------------------------------------------------------------------------------------------
# Machine info
# ----------------------------------------------------------------------------------------------------------


def git_commit() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    changed = [line[3:] for line in dirty if line.strip()]
    return f"{rev} + uncommitted changes in {', '.join(changed)}" if changed else (rev or None)


def machine_info(cfg: dict[str, Any]) -> dict[str, Any]:
    import flatshard

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flatshard": getattr(flatshard, "__version__", None),
        "git_commit": git_commit(),
        "loadavg_at_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    if cfg["device"] == "cuda" and torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------------------------------------
# Output: tables, JSON, plots
# ----------------------------------------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A padded Markdown table; a row of two cells is a failed contender (its name and the error)."""
    widths = [max([len(h), *(len(r[i]) for r in rows if len(r) > 2)]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in rows:
        if len(r) == 2:
            lines.append(f"| {r[0].ljust(widths[0])} | {r[1]} |")
        else:
            lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in text.strip().splitlines()[-12:])


def utc_now() -> str:
    """The current UTC time, to the second (ISO 8601): the ``date`` of a report."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_out(filename: str) -> Path:
    """Where a result goes unless ``--out`` says otherwise: ``docs/bench/<filename>``."""
    return REPO / "docs" / "bench" / filename


def write_json(
    path: Path,
    report: Any,
    *,
    indent: int = 2,
    default: Callable[[Any], Any] | None = None,
    newline: bool = True,
) -> None:
    """``report`` as JSON (``default``: for what json cannot encode) with a final newline, unless
    ``newline=False``."""
    path.write_text(json.dumps(report, indent=indent, default=default) + ("\n" if newline else ""))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str) -> None:
    """Title, tight layout, PNG at 120 dpi, then close the figure."""
    plt = pyplot()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
