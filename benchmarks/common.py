"""What the benchmark scripts share: the model, the rank helpers, measurement, machine info and output.

* **The model**: the GPT of ``examples/gpt/model.py`` (``GPT``, ``GPTConfig``, ``Block``), loaded from its
  file under the fixed module name ``GPT_MODULE_NAME`` (see :func:`_load_gpt_module`), the presets of
  ``step_time.py`` (``PRESETS``, also used by the other scripts), :func:`build_model` (identical init on
  every rank and for every contender) and :func:`make_batches` (the same token batches for everyone).
* **The contenders** of ``step_time.py`` (flatshard, FSDP1, FSDP2, DDP), which ``memory.py`` builds the
  same way: :func:`wrap_contender`, ``CONTENDER_DESCRIPTIONS``.
* **Ranks**: :func:`spawn_ranks` (fresh processes and a fresh process group per call, through
  ``flatshard.testing.spawn``) and :func:`barrier`.
* **Measurement**: ``/proc`` readers (:func:`proc_status_kib`, :func:`rss_kib`), :func:`reset_peak_rss`
  (``VmHWM``), :func:`mib`, :func:`median`.
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
import os
import platform
import statistics
import subprocess
import sys
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

FLATSHARD_CONTENDERS = ("flatshard", "flatshard_grad_op", "flatshard_compiled")
CONTENDER_DESCRIPTIONS = {
    "flatshard": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}",
    "flatshard_grad_op": "flatshard.shard SHARD_GRAD_OP, auto_wrap_policy={Block}",
    "flatshard_compiled": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, each Block compiled in place"
    " (compile_units: torch.compile, the config's compile_kwargs)",
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
        model = _wrap_flatshard(model, cfg, device, strategy, info)
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
            return DistributedDataParallel(model.to(device), device_ids=[rank])
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
        dist.barrier(device_ids=[device.index])
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
