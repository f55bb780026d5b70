"""Loading a Hugging Face checkpoint into a sharded model, and writing one back.

Setup (once, not timed, kept in ``--workdir`` and reused while the config is the same): a Llama-shaped
``LlamaForCausalLM`` built from a config (no download), random bf16 weights (norms drawn from U(0.5, 1.5), so a
norm left at its initial ones shows), saved by transformers' own ``save_pretrained(dir, max_shard_size=...)`` as
several ``.safetensors`` files and the index. From the files: each parameter's float64 sum and the largest tensor;
from ``from_pretrained(dir)`` in one process: the logits of a fixed input (the reference).

Loading, each contender in fresh gloo ranks (``torch.set_num_threads(1)``), for each world size of ``--ranks``:

- ``flatshard_load_pretrained``: ``AutoModelForCausalLM.from_config(config, dtype=bfloat16)`` on the meta device,
  ``flatshard.shard(model, auto_wrap_policy={LlamaDecoderLayer})``, ``flatshard.load_pretrained(model, dir)``;
- ``from_pretrained_every_rank``: ``from_pretrained(dir, dtype=bfloat16)`` on every rank, then ``flatshard.shard``;
- ``rank0_sync_module_states``: ``from_pretrained`` on rank 0, the meta model on the others, then
  ``flatshard.shard(model, sync_module_states=True)`` (rank 0's values are broadcast unit by unit).

Per rank: the peak RSS growth over the load (``VmHWM`` reset with ``clear_refs`` right before it, minus ``VmRSS``
then: after imports, the process group and a warm-up, before the model is built; the peaks of anonymous and of
file-backed pages sampled apart), the time from one barrier to the next (model build + shard + weights, and each
step), the bytes read (``PretrainedLoad.bytes_read`` for flatshard; ``rchar`` and ``read_bytes`` of
``/proc/self/io``, which do not count mapped file pages, for everyone), and the bytes of parameters the rank keeps
(its shard). Target: growth <= 1.1 x (shard + the
largest tensor of the checkpoint) on every rank, and time <= ``from_pretrained_every_rank``'s. Before anything is
compared, each contender's parameters (per-parameter float64 sums over the ranks' pieces) must equal the files'
and its logits the reference's; a contender that fails the check is marked so and the exit status is 1.

Export: ``flatshard.save_pretrained(model, out, max_shard_size=...)`` of the loaded sharded model on each world
size, and transformers' ``model.save_pretrained(out, max_shard_size=...)`` of the unsharded model in one
process: time and peak RSS growth over the write (transformers does not fsync its files, flatshard does: the fsync
is timed after it). Every written directory must hold the source's tensors, bit for bit, and load with
``from_pretrained`` (no missing or unexpected names, the reference's logits).

    python benchmarks/pretrained.py --preset tiny     # 3.6 MB of weights, ~3.5 min (mostly starting ranks)
    python benchmarks/pretrained.py --preset llama-1b --ranks 2,4 --repeats 3 --touch-host-mib 8192   # ~17 min

``--repeats N`` runs every contender N times, interleaved (the largest growth and the median time are reported);
``--touch-host-mib N`` touches and frees N MiB before each contender (see ``bench_measure.touch_host_memory``).

Writes ``docs/bench/pretrained_<preset>.json`` and ``.png`` and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_contenders import barrier, spawn_ranks
from bench_measure import MIB, PeakRSS, malloc_trim, median, reset_peak_rss, touch_host_memory
from bench_output import (
    default_out,
    fmt,
    machine_info,
    markdown_table,
    pyplot,
    save_figure,
    utc_now,
    write_json,
)

LOAD_CONTENDERS = ("flatshard_load_pretrained", "from_pretrained_every_rank", "rank0_sync_module_states")
EXPORT_CONTENDERS = ("flatshard_save_pretrained", "hf_save_pretrained")
DESCRIPTIONS = {
    "flatshard_load_pretrained": "from_config on the meta device -> flatshard.shard(auto_wrap_policy="
    "{LlamaDecoderLayer}) -> flatshard.load_pretrained(model, dir)",
    "from_pretrained_every_rank": "from_pretrained(dir, dtype=bfloat16) on every rank -> flatshard.shard(...)",
    "rank0_sync_module_states": "from_pretrained on rank 0, from_config on the meta device on the others -> "
    "flatshard.shard(..., sync_module_states=True)",
    "flatshard_save_pretrained": "flatshard.save_pretrained(sharded model, out, max_shard_size=...) on every rank",
    "hf_save_pretrained": "from_pretrained in one process, then model.save_pretrained(out, max_shard_size=...)",
}
SHORT = {
    "flatshard_load_pretrained": "flatshard",
    "from_pretrained_every_rank": "from_pretrained",
    "rank0_sync_module_states": "rank0+sync",
    "flatshard_save_pretrained": "flatshard",
    "hf_save_pretrained": "HF",
}
COMMON = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
PRESETS: dict[str, dict[str, Any]] = {
    # ~1.8M parameters, ~3.6 MB: for a quick check.
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_shard_size": "1MB",
    },
    # TinyLlama-1.1B's shape: 1.10B parameters, 2.2 GB in bf16.
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "intermediate_size": 5632,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_shard_size": "500MB",
    },
}
WARMUP = "tiny"  # the model every rank loads (and writes) once before its baseline
SEED = 0
TOKENS = (1, 16)  # the fixed input of the logits check: batch, sequence
TARGET_SLACK = 1.10  # growth <= 1.1 x (shard + largest tensor)
LOGITS_ATOL = 1e-2
SETUP_VERSION = 1  # bump when what setup writes changes


# ----------------------------------------------------------------------------------------------------------
# Setup: the checkpoint, its sums, the reference logits
# ----------------------------------------------------------------------------------------------------------


def _llama_config(preset: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    fields = {k: v for k, v in preset.items() if k != "max_shard_size"}
    return LlamaConfig(**COMMON, **fields)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(7))


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(_tokens(vocab), use_cache=False).logits.float()


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _file_sums(folder: Path) -> tuple[dict[str, float], dict[str, Any], int]:
    """Per tensor its float64 sum; the largest tensor (name, bytes, shape); the data bytes of the files."""
    from safetensors import safe_open

    sums: dict[str, float] = {}
    largest: dict[str, Any] = {"name": None, "bytes": 0, "shape": None}
    data = 0
    for f in _safetensors_files(folder):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                sums[key] = float(t.double().sum())
                data += t.nbytes
                if t.nbytes > largest["bytes"]:
                    largest = {"name": key, "bytes": t.nbytes, "shape": list(t.shape)}
    return sums, largest, data


def _write_checkpoint(folder: Path, preset: dict[str, Any]) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(_llama_config(preset), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=preset["max_shard_size"])
    del model
    gc.collect()
    malloc_trim()
    return params


def setup_rank(
    rank: int, world: int, preset: dict[str, Any], folder: str, warmup_folder: str
) -> dict[str, Any]:
    """Writes the checkpoint and the warm-up checkpoint, returns the sums, sizes and reference logits."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    _write_checkpoint(Path(warmup_folder), PRESETS[WARMUP])
    t0 = time.perf_counter()
    params = _write_checkpoint(Path(folder), preset)
    write_s = time.perf_counter() - t0
    sums, largest, data = _file_sums(Path(folder))
    torch.set_num_threads(1)  # the ranks' kernels, for the reference logits
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    logits = _logits(model, preset["vocab_size"])
    return {
        "parameters": params,
        "sums": sums,
        "largest_tensor": largest,
        "data_bytes": data,
        "files": [f.name for f in _safetensors_files(Path(folder))],
        "write_s": write_s,
        "logits": logits,
    }


def _setup(args: argparse.Namespace, preset: dict[str, Any]) -> tuple[Path, Path, dict[str, Any]]:
    """The checkpoint folder, the warm-up folder and what setup found: reused when the config is the same."""
    key = {"version": SETUP_VERSION, "seed": SEED, "tokens": list(TOKENS), "preset": preset, "common": COMMON}
    tag = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    root = args.workdir / f"{args.preset}-{tag}"
    folder, warmup, meta_file, logits_file = (
        root / "checkpoint",
        root / "warmup",
        root / "setup.json",
        root / "reference_logits.pt",
    )
    if meta_file.exists() and logits_file.exists():
        meta = json.loads(meta_file.read_text())
        if meta.get("key") == key and all((folder / f).exists() for f in meta["files"]):
            print(f"[setup] reusing {folder}", flush=True)
            meta["logits"] = torch.load(logits_file, weights_only=True)
            meta["reused"] = True
            return folder, warmup, meta
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"[setup] writing the {args.preset} checkpoint to {folder} ...", flush=True)
    meta = spawn_ranks(setup_rank, 1, preset, str(folder), str(warmup), backend="gloo", timeout=args.timeout)[
        0
    ]
    torch.save(meta["logits"], logits_file)
    meta_file.write_text(
        json.dumps({**{k: v for k, v in meta.items() if k != "logits"}, "key": key}, indent=1)
    )
    meta["reused"] = False
    return folder, warmup, meta


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------------


def _imports() -> None:
    """Everything the recipes import, before the baseline (``shard()`` imports dynamo: 26 MiB, once)."""
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: F401

    import flatshard  # noqa: F401


def _recipe(name: str, folder: str, rank: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build, shard and fill the model as the contender ``name`` does; ``info["phases_s"]``: the time of each
    step (``build``: ``from_config`` on the meta device, or ``from_pretrained`` with the weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import flatshard

    policy = {LlamaDecoderLayer}
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    meta = name == "flatshard_load_pretrained" or (name == "rank0_sync_module_states" and rank != 0)
    if name not in LOAD_CONTENDERS:
        raise ValueError(f"unknown contender {name!r}")
    if meta:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    flatshard.shard(model, auto_wrap_policy=policy, sync_module_states=name == "rank0_sync_module_states")
    t2 = time.perf_counter()
    if name == "flatshard_load_pretrained":
        loaded = flatshard.load_pretrained(model, folder)
        info = {
            "bytes_read": loaded.bytes_read,
            "loaded": len(loaded.loaded),
            "missing": loaded.missing,
            "unexpected": loaded.unexpected,
            "notes": loaded.notes,
        }
    t3 = time.perf_counter()
    info["phases_s"] = {"build": t1 - t0, "shard": t2 - t1, "load_pretrained": t3 - t2}
    return model, info


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


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class RssSplit:
    """Peaks of ``RssAnon``, ``RssFile`` (mapped file pages: a ``from_pretrained`` model's mmap-ed weights once
    touched) and ``RssShmem`` of this process, sampled every ``interval`` s on a thread (spikes between samples
    can be missed; the exact total is ``VmHWM``)."""

    KEYS = ("RssAnon", "RssFile", "RssShmem")

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1

    def _read(self) -> list[int]:
        data = os.pread(self._fd, 8192, 0).decode()
        values = dict.fromkeys(self.KEYS, 0)
        for line in data.splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0])
        return [values[k] for k in self.KEYS]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = [max(a, b) for a, b in zip(self.peak, self._read())]

    def __enter__(self) -> RssSplit:
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self.base = self._read()
        self.peak = list(self.base)
        self._thread = threading.Thread(target=self._run, name="rss-split", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.end = self._read()
        self.peak = [max(a, b) for a, b in zip(self.peak, self.end)]
        os.close(self._fd)

    def result(self) -> dict[str, dict[str, float]]:
        return {
            "peak_growth_mib": {
                k: round((p - b) / 1024, 1) for k, p, b in zip(self.KEYS, self.peak, self.base)
            },
            "end_growth_mib": {
                k: round((e - b) / 1024, 1) for k, e, b in zip(self.KEYS, self.end, self.base)
            },
        }


def _quiet() -> None:
    """Everything freed and trimmed, then a barrier: the state the baseline is read in."""
    gc.collect()
    malloc_trim()
    dist.barrier()


def _measured(method: str, region: Any) -> dict[str, Any]:
    """Run ``region()`` between barriers under a reset peak: per rank its growth, time, I/O, CPU."""
    cpu = torch.device("cpu")
    io0, cpu0 = _io(), _cpu_s()
    with PeakRSS(method) as peak, RssSplit() as split:
        barrier(cpu)
        t0 = time.perf_counter()
        value = region()
        barrier(cpu)
        elapsed = time.perf_counter() - t0
    io1 = _io()
    return {
        "value": value,
        "elapsed_s": elapsed,
        "cpu_s": _cpu_s() - cpu0,
        "baseline_mib": round(peak.base_kib / 1024, 1),
        "peak_growth_mib": peak.extra_mib,
        "retained_mib": peak.retained_mib,
        "split": split.result(),
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
    }


def _checks(model: torch.nn.Module, vocab: int) -> tuple[dict[str, float], torch.Tensor]:
    """Per parameter the float64 sum of every rank's piece, and the logits of the fixed input (collective)."""
    names, sums = [], []
    for n, p in model.named_parameters():
        names.append(n)
        sums.append(p.detach().double().sum())
    total = torch.stack(sums)
    dist.all_reduce(total)
    return dict(zip(names, total.tolist())), _logits(model, vocab)


def load_rank(rank: int, world: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    _imports()
    if cfg["warm_up"]:  # code pages, lazy imports, the transport's segments: not what the model costs
        warm, _ = _recipe(name, cfg["warmup_folder"], rank)
        _checks(warm, PRESETS[WARMUP]["vocab_size"])
        del warm
    _quiet()
    m = _measured(cfg["peak_method"], lambda: _recipe(name, cfg["folder"], rank))
    model, info = m.pop("value")
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sums, logits = _checks(model, cfg["vocab_size"])
    out = {**m, **info, "shard_bytes": shard_bytes}
    if rank == 0:
        out["sums"], out["logits"] = sums, logits
    return out


def _fsync_folder(folder: Path) -> None:
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_rank(rank: int, world: int, name: str, cfg: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Load (flatshard's recipe, or from_pretrained unsharded for ``hf_save_pretrained``), then write, measured.
    transformers does not fsync what it writes (flatshard does, then renames): its fsync is timed after."""
    from transformers import AutoModelForCausalLM

    import flatshard

    torch.set_num_threads(1)
    _imports()
    max_shard = cfg["max_shard_size"]

    def load(folder: str) -> torch.nn.Module:
        if name == "hf_save_pretrained":
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        return _recipe("flatshard_load_pretrained", folder, rank)[0]

    def write(model: torch.nn.Module, out: str, limit: str) -> None:
        if name == "hf_save_pretrained":
            model.save_pretrained(out, max_shard_size=limit)
        else:
            flatshard.save_pretrained(model, out, max_shard_size=limit)

    if cfg["warm_up"]:
        warm = load(cfg["warmup_folder"])
        write(warm, out_dir + ".warmup", PRESETS[WARMUP]["max_shard_size"])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(out_dir + ".warmup", ignore_errors=True)
        del warm
    model = load(cfg["folder"])
    _quiet()
    m = _measured(cfg["peak_method"], lambda: write(model, out_dir, max_shard))
    m.pop("value")
    if name == "hf_save_pretrained":
        t0 = time.perf_counter()
        _fsync_folder(Path(out_dir))
        m["fsync_s"] = time.perf_counter() - t0
    elif rank == 0:  # flatshard writes the weights only
        shutil.copy(Path(cfg["folder"]) / "config.json", Path(out_dir) / "config.json")
    return m


def check_export(cfg: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """The written directory against the source: every tensor bit for bit, and ``from_pretrained`` of it (in
    the parent, with one thread, as the reference logits were computed)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = Path(cfg["folder"])
    out = Path(out_dir)

    def tensors(folder: Path) -> dict[str, Path]:
        where = {}
        for f in _safetensors_files(folder):
            with safe_open(f, framework="pt") as st:
                where.update(dict.fromkeys(st.keys(), f))
        return where

    mine, theirs = tensors(out), tensors(src)
    result: dict[str, Any] = {
        "files": sorted(p.name for p in out.iterdir()),
        "bytes": sum(p.stat().st_size for p in _safetensors_files(out)),
        "missing_names": sorted(set(theirs) - set(mine)),
        "extra_names": sorted(set(mine) - set(theirs)),
        "differing": [],
    }
    for key in sorted(set(mine) & set(theirs)):
        with safe_open(mine[key], framework="pt") as a, safe_open(theirs[key], framework="pt") as b:
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                result["differing"].append(key)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    result["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    result["logits"] = _logits(model, cfg["vocab_size"])
    del model
    gc.collect()
    malloc_trim()
    torch.set_num_threads(threads)
    return result


# ----------------------------------------------------------------------------------------------------------
# The parent: contenders one after another, checks, targets
# ----------------------------------------------------------------------------------------------------------


def _check_load(r0: dict[str, Any], setup: dict[str, Any]) -> dict[str, Any]:
    expected = setup["sums"]
    sums = r0.pop("sums")
    wrong = [
        n for n in expected if n not in sums or abs(sums[n] - expected[n]) > 1e-9 * max(1.0, abs(expected[n]))
    ]
    extra = sorted(set(sums) - set(expected))
    diff = float((r0.pop("logits") - setup["logits"]).abs().max())
    ok = not wrong and not extra and diff <= LOGITS_ATOL
    return {
        "ok": ok,
        "param_sums_differ": wrong[:10],
        "params_not_in_checkpoint": extra,
        "logits_max_abs_diff": diff,
    }


def _per_rank_over_runs(runs: list[list[dict[str, Any]]], get: Any, how: Any) -> list[Any]:
    """``how`` (max, median) over the runs of ``get(rank's result)``, per rank."""
    return [how([get(run[k]) for run in runs]) for k in range(len(runs[0]))]


def _measures(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What loads and exports share: per rank the largest peak growth over the runs (and its anon / file split),
    the median time (of the slowest rank) and CPU seconds; every run's values too."""
    keys = RssSplit.KEYS
    return {
        "peak_growth_mib": _per_rank_over_runs(runs, lambda r: r["peak_growth_mib"], max),
        "peak_growth_mib_runs": [[r["peak_growth_mib"] for r in run] for run in runs],
        "peak_split_mib": {
            k: _per_rank_over_runs(runs, lambda r, k=k: r["split"]["peak_growth_mib"][k], max) for k in keys
        },
        "retained_mib": _per_rank_over_runs(runs, lambda r: r["retained_mib"], max),
        "baseline_mib": _per_rank_over_runs(runs, lambda r: r["baseline_mib"], median),
        "time_s": median([max(r["elapsed_s"] for r in run) for run in runs]),
        "time_s_runs": [max(r["elapsed_s"] for r in run) for run in runs],
        "cpu_s": _per_rank_over_runs(runs, lambda r: r["cpu_s"], median),
        "rchar": _per_rank_over_runs(runs, lambda r: r["rchar"], max),
        "read_bytes": _per_rank_over_runs(runs, lambda r: r["read_bytes"], max),
        "wchar": _per_rank_over_runs(runs, lambda r: r["wchar"], max),
    }


def _load_result(
    runs: list[list[dict[str, Any]]], checks: list[dict[str, Any]], setup: dict
) -> dict[str, Any]:
    largest = setup["largest_tensor"]["bytes"]
    first = runs[0]
    shard_mib = [r["shard_bytes"] / MIB for r in first]
    target_mib = [TARGET_SLACK * (s + largest / MIB) for s in shard_mib]
    result: dict[str, Any] = {
        "check": {
            "ok": all(c["ok"] for c in checks),
            "logits_max_abs_diff": max(c["logits_max_abs_diff"] for c in checks),
            "runs": checks,
        },
        **_measures(runs),
        "shard_mib": [round(s, 1) for s in shard_mib],
        "target_mib": [round(t, 1) for t in target_mib],
        "phases_s": {
            p: _per_rank_over_runs(runs, lambda r, p=p: r["phases_s"][p], median)
            for p in ("build", "shard", "load_pretrained")
        },
    }
    result["growth_target_met"] = all(g <= t for g, t in zip(result["peak_growth_mib"], target_mib))
    if "bytes_read" in first[0]:
        result["bytes_read"] = [r["bytes_read"] for r in first]
        result["load_pretrained"] = {k: first[0][k] for k in ("loaded", "missing", "unexpected", "notes")}
    return result


def _touch(cfg: dict[str, Any]) -> None:
    """On a VM whose host backs memory lazily, the first touch of memory not used for a while costs a host fault:
    touching and freeing ``--touch-host-mib`` right before each contender starts every one alike."""
    if cfg["touch_host_mib"]:
        print(
            f"    touched {cfg['touch_host_mib']} MiB in {touch_host_memory(cfg['touch_host_mib']):.2f} s",
            flush=True,
        )


def _error(err: BaseException) -> dict[str, Any]:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def run_loads(
    cfg: dict[str, Any], setup: dict[str, Any], worlds: list[int], contenders: list[str], repeats: int
) -> dict:
    runs: dict[tuple[int, str], list[Any]] = {(w, n): [] for w in worlds for n in contenders}
    checks: dict[tuple[int, str], list[dict[str, Any]]] = {k: [] for k in runs}
    errors: dict[tuple[int, str], dict[str, Any]] = {}
    for rep in range(repeats):  # the contenders interleaved, so slow phases of the machine hit them all
        for world in worlds:
            for name in contenders:
                if (world, name) in errors:
                    continue
                print(f"[load N={world}, run {rep + 1}/{repeats}] {name} ...", flush=True)
                _touch(cfg)
                try:
                    ranks = spawn_ranks(load_rank, world, name, cfg, backend="gloo", timeout=cfg["timeout"])
                except Exception as err:  # one contender failing must not lose the others' numbers
                    errors[(world, name)] = _error(err)
                    print(f"    FAILED: {errors[(world, name)]['error'].splitlines()[0][:300]}", flush=True)
                    continue
                check = _check_load(ranks[0], setup)
                runs[(world, name)].append(ranks)
                checks[(world, name)].append(check)
                growth = " / ".join(fmt(r["peak_growth_mib"], ".0f") for r in ranks)
                elapsed = max(r["elapsed_s"] for r in ranks)
                verdict = "ok" if check["ok"] else "FAILED " + json.dumps(check)
                print(f"    growth MiB {growth}, {elapsed:.2f} s, check {verdict}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for world in worlds:
        by_name = results[str(world)] = {}
        for name in contenders:
            key = (world, name)
            by_name[name] = errors[key] if key in errors else _load_result(runs[key], checks[key], setup)
        fs, hf = by_name.get(LOAD_CONTENDERS[0]), by_name.get(LOAD_CONTENDERS[1])
        if fs and hf and "error" not in fs and "error" not in hf:
            fs["time_target_met"] = fs["time_s"] <= hf["time_s"]
    return results


def _check_export_ok(check: dict[str, Any]) -> bool:
    info = check["loading_info"]
    return (
        not check["missing_names"]
        and not check["extra_names"]
        and not check["differing"]
        and not info.get("missing_keys")
        and not info.get("unexpected_keys")
        and not info.get("mismatched_keys")
        and check["logits_max_abs_diff"] <= LOGITS_ATOL
    )


def run_exports(
    cfg: dict[str, Any], setup: dict[str, Any], worlds: list[int], root: Path, repeats: int
) -> dict:
    plan = [("hf_save_pretrained", 1)] + [("flatshard_save_pretrained", w) for w in worlds]
    runs: dict[str, list[Any]] = {f"{n}/{w}": [] for n, w in plan}
    checks: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    errors: dict[str, dict[str, Any]] = {}
    for rep in range(repeats):
        for name, world in plan:
            key = f"{name}/{world}"
            if key in errors:
                continue
            out = root / f"export-{name}-{world}"
            shutil.rmtree(out, ignore_errors=True)
            print(f"[export N={world}, run {rep + 1}/{repeats}] {name} ...", flush=True)
            _touch(cfg)
            try:
                ranks = spawn_ranks(
                    export_rank, world, name, cfg, str(out), backend="gloo", timeout=cfg["timeout"]
                )
                check = check_export(cfg, str(out))
            except Exception as err:
                errors[key] = _error(err)
                print(f"    FAILED: {errors[key]['error'].splitlines()[0][:300]}", flush=True)
                continue
            finally:
                if not cfg["keep_exports"]:
                    shutil.rmtree(out, ignore_errors=True)
            check["logits_max_abs_diff"] = float((check.pop("logits") - setup["logits"]).abs().max())
            check["ok"] = _check_export_ok(check)
            runs[key].append(ranks)
            checks[key].append(check)
            elapsed = max(r["elapsed_s"] for r in ranks)
            verdict = "ok" if check["ok"] else "FAILED " + json.dumps(check)[:500]
            print(
                f"    rank-0 growth {ranks[0]['peak_growth_mib']:.0f} MiB, {elapsed:.2f} s, check {verdict}",
                flush=True,
            )
    results: dict[str, Any] = {}
    for name, world in plan:
        key = f"{name}/{world}"
        if key in errors:
            results[key] = errors[key]
            continue
        last = checks[key][-1]
        results[key] = {
            "contender": name,
            "ranks": world,
            **_measures(runs[key]),
            "check": {**last, "ok": all(c["ok"] for c in checks[key])},
        }
        if name == "hf_save_pretrained":
            results[key]["fsync_s"] = median([run[0]["fsync_s"] for run in runs[key]])
            results[key]["time_with_fsync_s"] = median(
                [run[0]["elapsed_s"] + run[0]["fsync_s"] for run in runs[key]]
            )
        else:  # flatshard's save fsyncs every file and the folder before it returns
            results[key]["time_with_fsync_s"] = results[key]["time_s"]
    return results


# ----------------------------------------------------------------------------------------------------------
# Tables and plot
# ----------------------------------------------------------------------------------------------------------


def _per_rank(xs: list[float] | None, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if xs is None else " / ".join(fmt(x / scale, spec) for x in xs)


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "**no**")


def _split(r: dict[str, Any]) -> str:
    """Rank 0's peak growth of anonymous and of file-backed pages (sampled; each its own peak)."""
    split = r["peak_split_mib"]
    return f"{fmt(split['RssAnon'][0], '.0f')} + {fmt(split['RssFile'][0], '.0f')}"


def phase_table(loads: dict[str, Any]) -> str:
    rows = []
    for world, by_name in loads.items():
        for name, r in by_name.items():
            if "error" not in r:
                rows.append([world, name, *(_per_rank(r["phases_s"][p], ".2f") for p in r["phases_s"])])
    return markdown_table(
        ["N", "contender", "build s (from_pretrained: with the weights)", "shard s", "load_pretrained s"],
        rows,
    )


def load_table(loads: dict[str, Any]) -> str:
    rows = []
    for world, by_name in loads.items():
        for name, r in by_name.items():
            if "error" in r:
                rows.append([world, f"{name}: FAILED: " + r["error"].splitlines()[0][:120]])
                continue
            rows.append(
                [
                    world,
                    name,
                    _per_rank(r["peak_growth_mib"]),
                    _split(r),
                    _per_rank(r["shard_mib"]),
                    _per_rank(r["target_mib"]),
                    _yes(r["growth_target_met"]),
                    fmt(r["time_s"], ".2f"),
                    _yes(r.get("time_target_met")),
                    fmt(max(r["cpu_s"]), ".2f"),
                    _per_rank(r.get("bytes_read"), ".0f", MIB),
                    _per_rank(r["rchar"], ".0f", MIB),
                    "ok" if r["check"]["ok"] else "**FAILED**",
                ]
            )
    return markdown_table(
        [
            "N",
            "contender",
            "peak growth MiB per rank",
            "rank 0: anon + file peaks MiB",
            "shard MiB",
            "target MiB",
            "growth ≤ target?",
            "time s",
            "time ≤ from_pretrained?",
            "CPU s (max rank)",
            "bytes read MiB (load_pretrained)",
            "rchar MiB",
            "weights, logits",
        ],
        rows,
    )


def ratio_table(loads: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows, ratios = [], {}
    for world, by_name in loads.items():
        fs = by_name.get(LOAD_CONTENDERS[0])
        if not fs or "error" in fs:
            continue
        for peer in LOAD_CONTENDERS[1:]:
            r = by_name.get(peer)
            if not r or "error" in r:
                continue
            growth = max(fs["peak_growth_mib"]) / max(r["peak_growth_mib"])
            per_rank = [a / b for a, b in zip(fs["peak_growth_mib"], r["peak_growth_mib"])]
            t = fs["time_s"] / r["time_s"]
            ratios[f"{world}/{peer}"] = {
                "growth_largest_rank": growth,
                "growth_per_rank": per_rank,
                "time": t,
            }
            rows.append(
                [
                    world,
                    f"flatshard / {SHORT[peer]}",
                    fmt(growth, ".2f"),
                    _per_rank(per_rank, ".2f"),
                    fmt(t, ".2f"),
                ]
            )
    table = markdown_table(["N", "ratio", "peak growth (largest rank)", "peak growth per rank", "time"], rows)
    return table, ratios


def export_table(exports: dict[str, Any]) -> str:
    rows = []
    for key, r in exports.items():
        if "error" in r:
            rows.append([key, "FAILED: " + r["error"].splitlines()[0][:120]])
            continue
        rows.append(
            [
                r["contender"],
                str(r["ranks"]),
                fmt(r["peak_growth_mib"][0], ".0f"),
                _split(r),
                fmt(r["baseline_mib"][0] + r["peak_growth_mib"][0], ".0f"),
                _per_rank(r["peak_growth_mib"][1:]) if r["ranks"] > 1 else "-",
                fmt(r["time_s"], ".2f"),
                fmt(r["time_with_fsync_s"], ".2f"),
                fmt(r["cpu_s"][0], ".2f"),
                str(len([f for f in r["check"]["files"] if f.endswith(".safetensors")])),
                "ok" if r["check"]["ok"] else "**FAILED**",
            ]
        )
    return markdown_table(
        [
            "export",
            "ranks",
            "rank-0 peak growth MiB",
            "rank 0: anon + file peaks MiB",
            "rank-0 peak RSS MiB",
            "other ranks MiB",
            "time s",
            "time with fsync s",
            "rank-0 CPU s",
            "files",
            "same tensors, from_pretrained loads it",
        ],
        rows,
    )


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        plt = pyplot()
    except ImportError:  # matplotlib is optional: the JSON has the numbers
        return
    loads, exports = report["loads"], report["exports"]
    worlds = list(loads)
    cols = max(2, len(worlds))
    fig, axes = plt.subplots(2, cols, figsize=(5.2 * cols, 8), squeeze=False)
    colors = {"flatshard_load_pretrained": "tab:blue", "from_pretrained_every_rank": "tab:orange"}
    colors["rank0_sync_module_states"] = "tab:green"
    for ax, world in zip(axes[0], worlds):
        names = [n for n, r in loads[world].items() if "error" not in r]
        n_ranks = int(world)
        width = 0.8 / n_ranks
        for i, name in enumerate(names):
            r = loads[world][name]
            for k in range(n_ranks):
                x = i - 0.4 + (k + 0.5) * width
                ax.bar(x, r["peak_growth_mib"][k], width * 0.9, color=colors.get(name, "grey"))
                file_pages = r["peak_split_mib"]["RssFile"][k]
                ax.bar(x, file_pages, width * 0.9, fill=False, hatch="//", edgecolor="white", linewidth=0)
                ax.hlines(r["target_mib"][k], x - width / 2, x + width / 2, colors="black", linewidth=1.5)
        ax.set_xticks(range(len(names)), [SHORT[n] for n in names])
        ax.set_ylabel("peak RSS growth per rank, MiB (ranks 0..N-1)")
        ax.set_title(
            f"load, N = {world}; black: 1.1 x (shard + largest tensor); hatched: mapped file pages",
            fontsize=8,
        )
    for ax in axes[0][len(worlds) :]:
        ax.axis("off")
    ax = axes[1][0]
    width = 0.8 / max(1, len(LOAD_CONTENDERS))
    for j, name in enumerate(LOAD_CONTENDERS):
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(worlds))]
        ys = [loads[w].get(name, {}).get("time_s", float("nan")) for w in worlds]
        ax.bar(xs, ys, width * 0.9, color=colors[name], label=SHORT[name])
    ax.set_xticks(range(len(worlds)), [f"N = {w}" for w in worlds])
    ax.set_ylabel("load time, s (build + shard + weights)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    done = [(k, r) for k, r in exports.items() if "error" not in r]
    labels = [f"{SHORT[r['contender']]} N={r['ranks']}" for _, r in done]
    ax.bar(range(len(done)), [r["peak_growth_mib"][0] for _, r in done], color="tab:purple")
    file_pages = [r["peak_split_mib"]["RssFile"][0] for _, r in done]
    ax.bar(range(len(done)), file_pages, fill=False, hatch="//", edgecolor="white", linewidth=0)
    for i, (_, r) in enumerate(done):
        ax.annotate(
            f"{r['time_s']:.2f} s", (i, r["peak_growth_mib"][0]), ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(range(len(done)), labels)
    ax.set_ylabel("export: rank-0 peak RSS growth, MiB (time on top)")
    ax.set_title("hatched: mapped file pages (the source checkpoint's, read by the write)", fontsize=8)
    for ax in axes[1][2:]:
        ax.axis("off")
    cfg = report["config"]
    save_figure(
        fig,
        path,
        f"Pretrained weights, {cfg['preset']} ({cfg['parameters'] / 1e6:.0f}M parameters, bf16), CPU, gloo",
    )


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--contenders", default=",".join(LOAD_CONTENDERS), help="load contenders, in this order")
    p.add_argument("--no-export", action="store_true", help="skip the export part")
    p.add_argument(
        "--no-warm-up", action="store_true", help="no warm-up load (and write) before the baseline"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "flatshard_bench_pretrained",
        help="where the checkpoint and the exports go (the checkpoint is reused while the config is the same)",
    )
    p.add_argument("--keep-exports", action="store_true", help="keep the exported directories")
    p.add_argument("--repeats", type=int, default=1, help="runs of every contender, interleaved")
    p.add_argument(
        "--touch-host-mib",
        type=int,
        default=0,
        help="before each contender, touch and free this much memory (0: no; see bench_measure.touch_host_memory)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per set of ranks")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    worlds = [int(w) for w in args.ranks.split(",") if w]
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(contenders) - set(LOAD_CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {', '.join(LOAD_CONTENDERS)}")
    started = time.perf_counter()
    cfg: dict[str, Any] = {
        "preset": args.preset,
        "model": {**COMMON, **{k: v for k, v in preset.items() if k != "max_shard_size"}},
        "dtype": "bfloat16",
        "max_shard_size": preset["max_shard_size"],
        "world_sizes": worlds,
        "threads_per_rank": 1,
        "backend": "gloo",
        "warm_up": not args.no_warm_up,
        "repeats": args.repeats,
        "touch_host_mib": args.touch_host_mib,
        "peak_method": "vmhwm" if reset_peak_rss() else "sampler",
        "timeout": args.timeout,
        "keep_exports": args.keep_exports,
        "vocab_size": preset["vocab_size"],
        "target": f"peak growth <= {TARGET_SLACK} x (shard + largest tensor) on every rank; "
        "flatshard's load time <= from_pretrained_every_rank's",
    }
    machine = machine_info({"device": "cpu"})
    folder, warmup, setup = _setup(args, preset)
    cfg.update(folder=str(folder), warmup_folder=str(warmup), parameters=setup["parameters"])
    largest = setup["largest_tensor"]
    print(
        f"[setup] {setup['parameters']:,} parameters, {setup['data_bytes'] / 1e9:.3f} GB in "
        f"{len(setup['files'])} files; largest tensor {largest['name']} {largest['shape']} "
        f"({largest['bytes'] / MIB:.1f} MiB)",
        flush=True,
    )
    loads = run_loads(cfg, setup, worlds, contenders, args.repeats)
    exports = {} if args.no_export else run_exports(cfg, setup, worlds, folder.parent, args.repeats)
    machine["loadavg_at_end"] = list(os.getloadavg())
    ratios_md, ratios = ratio_table(loads)
    report: dict[str, Any] = {
        "benchmark": "pretrained",
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine,
        "config": {k: v for k, v in cfg.items() if k not in ("folder", "warmup_folder", "timeout")},
        "contenders": {n: DESCRIPTIONS[n] for n in (*contenders, *EXPORT_CONTENDERS)},
        "checkpoint": {
            "files": setup["files"],
            "data_bytes": setup["data_bytes"],
            "largest_tensor": largest,
            "setup_reused": setup["reused"],
            "write_s": setup.get("write_s"),
        },
        "loads": loads,
        "ratios": ratios,
        "exports": exports,
        "wall_s": time.perf_counter() - started,
    }
    tables = {
        "load": load_table(loads),
        "phases": phase_table(loads),
        "ratios": ratios_md,
        "export": export_table(exports),
    }
    report["tables"] = tables
    out = args.out or default_out(f"pretrained_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(
        f"\n{args.preset}: {setup['parameters']:,} parameters, bf16, {len(setup['files'])} files, largest tensor "
        f"{largest['bytes'] / MIB:.1f} MiB; loadavg {machine['loadavg_at_start']} -> {machine['loadavg_at_end']}\n"
    )
    print(tables["load"], "\n")
    print(tables["phases"], "\n")
    print(tables["ratios"], "\n")
    if exports:
        print(tables["export"], "\n")
    failed = [
        f"load N={w} {n}"
        for w, by in loads.items()
        for n, r in by.items()
        if "error" in r or not r["check"]["ok"]
    ] + [k for k, r in exports.items() if "error" in r or not r["check"]["ok"]]
    if failed:
        print("FAILED (errors or checks): " + ", ".join(failed))
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
