"""Time and memory to gather the full model + optimizer state on rank 0: flatshard vs torch FSDP1 / FSDP2.

Every contender builds the same GPT (``examples/gpt/model.py``) from the same seed on ``--world-size``
ranks (default 2), in freshly spawned processes with a fresh process group (gloo on CPU), shards it,
creates ``AdamW(lr=1e-4)`` and trains one step on a fixed random batch so that the optimizer has state
(``step``, ``exp_avg``, ``exp_avg_sq``). Then it measures, per contender:

* **gather**: the wall time of one call that returns the full, consolidated model and optimizer state on
  rank 0 (other ranks get empty dicts), offloaded to CPU; median of ``--repeats`` calls, each after a
  barrier. The calls are

  - ``flatshard``: ``flatshard.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)``
  - ``fsdp1``: ``model.state_dict()`` + ``FSDP.optim_state_dict(model, opt)`` under
    ``FSDP.state_dict_type(FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
    FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))``
  - ``fsdp2``: ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt,
    options=StateDictOptions(full_state_dict=True, cpu_offload=True))``

* **extra peak memory per rank during the gather**: the RSS high-water mark (``VmHWM``, reset with
  ``echo 5 > /proc/self/clear_refs`` right before the call) minus the RSS just before the call; where
  the reset is not permitted, the maximum of ``VmRSS`` sampled every 5 ms by a background thread minus the
  RSS before. On rank 0 this includes the gathered state itself, which is still alive at the peak.
* **full state size**: the bytes of all tensors of the model + optimizer state on rank 0 (each storage
  counted once: a tied weight appears under two keys).
* **save** on rank 0 (``flatshard.checkpoint.files.atomic_save`` for flatshard, which also fsyncs;
  ``torch.save`` for the peers) into a temporary directory, **load** on every rank
  (``torch.load(path, map_location="cpu", mmap=True)``) and, for flatshard,
  ``flatshard.set_state_dict(model, opt, model_sd, optim_sd)`` on every rank from the loaded dict.
* **correctness**: after all contenders ran, the main process reads the saved files back and checks
  that the model state dicts have the same keys and ``torch.equal`` tensors, and that the AdamW
  ``exp_avg`` tensors are equal (FSDP1/FSDP2's FQN-keyed optimizer state is mapped to flatshard's
  index-keyed one through the order of ``model.named_parameters()``).

    python benchmarks/checkpoint.py --preset tiny          # smoke run, seconds
    python benchmarks/checkpoint.py                        # cpu-large: 203M parameters, a few minutes

Writes ``docs/bench/checkpoint_<preset>.json`` and ``.png`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    MIB,
    MODEL_FIELDS,
    Block,
    barrier,
    build_model,
    default_out,
    fmt,
    indent,
    machine_info,
    make_batches,
    markdown_table,
    proc_status_kib,
    pyplot,
    reset_peak_rss,
    rss_kib,
    save_figure,
    spawn_ranks,
    utc_now,
    write_json,
)
from common import PRESETS as STEP_TIME_PRESETS

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layer=2, n_head=4, batch_size=2, seq_len=32, vocab_size=512, device="cpu"),
    # GPT-2-medium width, half its depth, GPT-2 vocabulary: 203M parameters (the "168M CPU preset").
    "cpu-large": dict(STEP_TIME_PRESETS["cpu-large"]),
}
ALL_CONTENDERS = ("flatshard", "fsdp1", "fsdp2")
DESCRIPTIONS = {
    "flatshard": "flatshard.get_state_dict(full=True, rank0_only=True, cpu_offload=True); "
    "model: flatshard.shard FULL_SHARD, auto_wrap_policy={Block}",
    "fsdp1": "FSDP1 FULL_STATE_DICT model.state_dict() + FSDP.optim_state_dict (rank0_only, offload_to_cpu); "
    "model: FullyShardedDataParallel, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp2": "torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True, "
    "cpu_offload=True); model: fully_shard per Block then root",
}
SAVE_CALLS = {
    "flatshard": "flatshard.checkpoint.files.atomic_save (temp file, fsync, rename)",
    "fsdp1": "torch.save",
    "fsdp2": "torch.save",
}
TARGET_TIME_RATIO = 0.2  # flatshard gather time <= 0.2x of each torch FSDP
TARGET_MEM_OVER_STATE = 1.0  # rank-0 extra peak memory <= full state size


# ----------------------------------------------------------------------------------------------------------
# Helpers used inside the ranks
# ----------------------------------------------------------------------------------------------------------


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


def _malloc_trim(cfg: dict[str, Any]) -> bool:
    """Give glibc's free heap memory back to the OS (``malloc_trim(0)``), so that the RSS before a gather is
    about the live memory and the gather's new allocations show up as RSS growth, instead of silently
    reusing what the model build, the training step or an earlier gather freed. False if unavailable."""
    if not cfg["malloc_trim"]:
        return False
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _tensor_bytes(obj: Any) -> tuple[int, int, int]:
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


def _shard(name: str, model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    if name == "flatshard":
        import flatshard

        flatshard.shard(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
        return model
    if name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # torch 2.13 refuses device_id=None for a CPU module; an explicit CPU device selects the CPU path.
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    if name == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown contender {name!r}")


def _fsdp1_gather(model: torch.nn.Module, opt: torch.optim.Optimizer, offload: bool) -> tuple[Any, Any]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
    ):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    return msd, osd


def _gather(
    name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, info: dict[str, Any]
) -> tuple[Any, Any]:
    """The timed call: full model + optimizer state on rank 0, on CPU (other ranks: empty)."""
    if name == "flatshard":
        import flatshard

        return flatshard.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)
    if name == "fsdp1":
        return _fsdp1_gather(model, opt, info["fsdp1_offload_to_cpu"])
    if name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    raise ValueError(name)


def _fault_log(cfg: dict[str, Any], name: str, rank: int) -> Path:
    return Path(cfg["tmpdir"]) / f"fault_{name}_{cfg.get('fsdp1_offload', '')}_rank{rank}.log"


def _crash_report(cfg: dict[str, Any], name: str, world_size: int) -> str:
    """What faulthandler wrote for a rank that died hard: the fatal error and the innermost frame."""
    lines = []
    for rank in range(world_size):
        path = _fault_log(cfg, name, rank)
        text = path.read_text().strip().splitlines() if path.exists() else []
        fatal = [ln for ln in text if ln.startswith("Fatal Python error")]
        if fatal:
            frames = [ln.strip() for ln in text if ln.strip().startswith("File ")]
            lines.append(f"rank {rank}: {fatal[0]}" + (f" at {frames[0]}" if frames else ""))
    return "; ".join(lines)


def run_contender(rank: int, world_size: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank of a fresh process group; returns this rank's measurements (small, picklable)."""
    torch.set_num_threads(cfg["threads"])
    # A hard crash (segfault) leaves no Python traceback: faulthandler writes one where the driver finds it.
    fault_log = open(_fault_log(cfg, name, rank), "w")  # stays open for the process lifetime
    faulthandler.enable(file=fault_log)
    device = torch.device("cpu")
    info: dict[str, Any] = {"rank": rank}
    t_setup = time.perf_counter()
    model = build_model(cfg)
    info["num_params"] = sum(p.numel() for p in model.parameters())  # tied weight counted once
    model = _shard(name, model, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Names in the order the optimizer numbers its parameters (flatshard's state is keyed by that index).
    info["param_names"] = [n for n, _ in model.named_parameters()] if rank == 0 else None

    # One training step so that AdamW has state.
    (idx, tgt), *_ = make_batches(dict(cfg, warmup=0, steps=1), rank, world_size, device)
    loss = F.cross_entropy(model(idx).view(-1, cfg["vocab_size"]), tgt.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    dist.all_reduce(loss)
    info["loss"] = loss.item() / world_size
    if name == "fsdp1":
        info["fsdp1_offload_to_cpu"] = cfg["fsdp1_offload"] == "on"
    # Untimed warm-up gathers (first-call costs).
    for _ in range(cfg["warmup"]):
        barrier(device)
        msd, osd = _gather(name, model, opt, info)
        del msd, osd
    gc.collect()
    info["malloc_trim"] = _malloc_trim(cfg)
    barrier(device)
    info["setup_s"] = time.perf_counter() - t_setup
    info["rss_before_gather_mib"] = round(rss_kib() / 1024, 1)

    method = cfg["memory_method"]
    if method == "auto":
        method = "vmhwm" if reset_peak_rss() else "sampler"
    info["memory_method"] = method

    times: list[float] = []
    extra: list[float] = []
    retained: list[float] = []
    msd: Any = None
    osd: Any = None
    for r in range(cfg["repeats"]):
        if r:
            del msd, osd  # the previous repeat's state: free it before the next gather
            msd = osd = None
            gc.collect()
            _malloc_trim(cfg)
        barrier(device)
        with PeakRSS(method) as probe:
            t0 = time.perf_counter()
            msd, osd = _gather(name, model, opt, info)
            times.append(time.perf_counter() - t0)
        extra.append(probe.extra_mib)
        retained.append(probe.retained_mib)
    info["gather_s"] = times
    info["gather_extra_peak_mib"] = extra
    info["gather_retained_mib"] = retained  # RSS after the call minus before: the state it returned
    if rank == 0:
        unique, total, count = _tensor_bytes((msd, osd))
        info["full_state_bytes"] = unique
        info["full_state_bytes_all_entries"] = total
        info["full_state_tensors"] = count
        info["model_state_keys"] = len(msd)
        info["optim_state_entries"] = len(osd.get("state", {})) if isinstance(osd, dict) else None
    else:
        info["rank_nonzero_state_empty"] = not msd and not osd

    # Save on rank 0 into the shared temporary directory.
    path = Path(cfg["tmpdir"]) / f"{name}.pt"
    if rank == 0:
        obj = {"model": msd, "optim": osd}
        t0 = time.perf_counter()
        if name == "flatshard":
            from flatshard.checkpoint.files import atomic_save

            atomic_save(obj, path)
        else:
            torch.save(obj, path)
        info["save_s"] = time.perf_counter() - t0
        info["file_bytes"] = path.stat().st_size
        if name == "flatshard":  # the same call as the peers, for an apples-to-apples comparison
            plain = path.with_suffix(".plain.pt")
            t0 = time.perf_counter()
            torch.save(obj, plain)
            info["save_plain_torch_save_s"] = time.perf_counter() - t0
            plain.unlink()
        del obj
    del msd, osd
    gc.collect()
    barrier(device)

    # Load on every rank (mmap: tensors are paged in when touched).
    t0 = time.perf_counter()
    loaded = torch.load(path, map_location="cpu", mmap=True)
    info["load_s"] = time.perf_counter() - t0
    if name == "flatshard":
        import flatshard

        barrier(device)
        t0 = time.perf_counter()
        flatshard.set_state_dict(model, opt, loaded["model"], loaded["optim"])
        info["set_state_dict_s"] = time.perf_counter() - t0
        barrier(device)
        # Round trip (untimed): gathering again must give back exactly what was loaded.
        msd2, osd2 = flatshard.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)
        if rank == 0:
            info["roundtrip_equal"] = _model_equal(loaded["model"], msd2)[0] and all(
                _optim_entry_equal(loaded["optim"]["state"][k], osd2["state"].get(k))
                for k in loaded["optim"]["state"]
            )
        del msd2, osd2
    del loaded
    gc.collect()
    barrier(device)
    return info


# ----------------------------------------------------------------------------------------------------------
# Correctness check (main process, from the saved files)
# ----------------------------------------------------------------------------------------------------------


def _model_equal(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
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


def _optim_entry_equal(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None or set(a) != set(b):
        return False
    return all(
        torch.equal(torch.as_tensor(a[k]).float(), torch.as_tensor(b[k]).float())
        if isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor)
        else a[k] == b[k]
        for k in a
    )


def _optim_by_name(name: str, osd: dict[str, Any], param_names: list[str]) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed by parameter name. flatshard numbers parameters in ``param_groups`` order
    (= ``model.named_parameters()`` order, the optimizer was built from ``model.parameters()``); FSDP1 and
    FSDP2 already key it by FQN."""
    state = osd["state"]
    if name == "flatshard":
        ids = [i for g in osd["param_groups"] for i in g["params"]]
        return {param_names[pos]: state[i] for pos, i in enumerate(ids) if i in state}
    return {str(k): v for k, v in state.items()}


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
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
    ref_opt = _optim_by_name(ref, loaded[ref]["optim"], param_names)
    out["optimizer_state_names_match_parameters"] = set(ref_opt) == set(param_names)
    all_equal = True
    pairs: dict[str, Any] = {}
    for c in loaded:
        if c == ref:
            continue
        model_eq, bad_keys = _model_equal(loaded[ref]["model"], loaded[c]["model"])
        opt_c = _optim_by_name(c, loaded[c]["optim"], param_names)
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
                    worst = max(worst, _max_abs_diff(a, b) or 0.0)
            entry[f"{key}_equal"] = not differing and entry["optim_same_param_names"]
            entry[f"{key}_params_differing"] = differing[:10]
            max_diff[key] = worst
        steps = {float(torch.as_tensor(st["step"]).item()) for st in [*ref_opt.values(), *opt_c.values()]}
        entry["step_values"] = sorted(steps)
        if not model_eq:
            max_diff["model"] = max(
                (_max_abs_diff(loaded[ref]["model"][k], loaded[c]["model"][k]) or 0.0)
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
# Driver
# ----------------------------------------------------------------------------------------------------------


def summarize(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    times0 = r0["gather_s"]
    res: dict[str, Any] = {
        "status": "ok",
        "description": DESCRIPTIONS[name],
        "num_params": r0["num_params"],
        "loss_after_step": r0["loss"],
        "memory_method": r0["memory_method"],
        "gather_s": statistics.median(times0),
        "gather_s_min": min(times0),
        "gather_s_per_repeat_per_rank": [[round(t, 4) for t in r["gather_s"]] for r in per_rank],
        "gather_s_max_over_ranks": statistics.median(
            [max(ts) for ts in zip(*[r["gather_s"] for r in per_rank])]
        ),
        "extra_peak_mib_per_rank": [statistics.median(r["gather_extra_peak_mib"]) for r in per_rank],
        "extra_peak_mib_max_over_repeats_per_rank": [max(r["gather_extra_peak_mib"]) for r in per_rank],
        "extra_peak_mib_per_repeat_per_rank": [r["gather_extra_peak_mib"] for r in per_rank],
        "retained_mib_per_rank": [statistics.median(r["gather_retained_mib"]) for r in per_rank],
        # peak minus what is still held after the call: the temporary overhead on top of the result
        "transient_mib_per_rank": [
            statistics.median([e - k for e, k in zip(r["gather_extra_peak_mib"], r["gather_retained_mib"])])
            for r in per_rank
        ],
        "malloc_trim": all(r["malloc_trim"] for r in per_rank),
        "rss_before_gather_mib_per_rank": [r["rss_before_gather_mib"] for r in per_rank],
        "full_state_bytes": r0["full_state_bytes"],
        "full_state_bytes_all_entries": r0["full_state_bytes_all_entries"],
        "full_state_tensors": r0["full_state_tensors"],
        "model_state_keys": r0["model_state_keys"],
        "optim_state_entries": r0["optim_state_entries"],
        "other_ranks_got_empty_state": all(r.get("rank_nonzero_state_empty") for r in per_rank[1:]),
        "save_call": SAVE_CALLS[name],
        "save_s": r0["save_s"],
        "file_bytes": r0["file_bytes"],
        "load_s_per_rank": [r["load_s"] for r in per_rank],
        "load_s": r0["load_s"],
        "setup_s": max(r["setup_s"] for r in per_rank),
    }
    res["extra_peak_mib_rank0"] = res["extra_peak_mib_per_rank"][0]
    res["rank0_extra_over_state"] = res["extra_peak_mib_rank0"] * MIB / res["full_state_bytes"]
    res["meets_memory_target"] = res["rank0_extra_over_state"] <= TARGET_MEM_OVER_STATE
    if "save_plain_torch_save_s" in r0:
        res["save_plain_torch_save_s"] = r0["save_plain_torch_save_s"]
    if name == "flatshard":
        res["set_state_dict_s_per_rank"] = [r["set_state_dict_s"] for r in per_rank]
        res["set_state_dict_s"] = max(res["set_state_dict_s_per_rank"])
        res["roundtrip_equal"] = r0.get("roundtrip_equal")
    if name == "fsdp1":
        res["fsdp1_offload_to_cpu"] = r0["fsdp1_offload_to_cpu"]
    return res


def compute_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """flatshard / peer (< 1: flatshard is faster / needs less memory)."""
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    if "flatshard" not in ok:
        return {}
    fs = ok["flatshard"]
    ratios = {}
    for peer, r in ok.items():
        if peer == "flatshard":
            continue
        t = fs["gather_s"] / r["gather_s"]
        ratios[f"flatshard/{peer}"] = {
            "gather_time_ratio": t,
            "meets_time_target": t <= TARGET_TIME_RATIO,
            "rank0_extra_mem_ratio": _ratio(fs["extra_peak_mib_rank0"], r["extra_peak_mib_rank0"]),
            "rank1_extra_mem_ratio": _ratio(
                fs["extra_peak_mib_per_rank"][-1], r["extra_peak_mib_per_rank"][-1]
            ),
            "save_time_ratio": fs["save_s"] / r["save_s"],
        }
    return ratios


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def format_table(results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> str:
    headers = [
        "contender",
        "gather s (median)",
        "gather s (min)",
        "extra peak MiB r0 / r1",
        "r0 peak - held MiB",
        "full state MiB",
        "r0 extra / state",
        "save s",
        "load s (mmap)",
        "set_state_dict s",
        "flatshard/this time",
        "flatshard/this r0 mem",
    ]
    rows = []
    for name, r in results.items():
        if r.get("status") != "ok":
            err = r.get("error", "").strip().splitlines()
            rows.append([name, "FAILED: " + (err[-1] if err else "?")[:90]])
            continue
        rat = ratios.get(f"flatshard/{name}")
        ref = name == "flatshard"
        rows.append(
            [
                name,
                fmt(r["gather_s"], ".3f"),
                fmt(r["gather_s_min"], ".3f"),
                " / ".join(fmt(x, ".0f") for x in r["extra_peak_mib_per_rank"]),
                fmt(r["transient_mib_per_rank"][0], ".0f"),
                fmt(r["full_state_bytes"] / MIB, ".0f"),
                fmt(r["rank0_extra_over_state"], ".2f"),
                fmt(r["save_s"], ".2f"),
                fmt(r["load_s"], ".3f"),
                fmt(r.get("set_state_dict_s"), ".3f"),
                "1 (ref)" if ref else fmt(rat and rat["gather_time_ratio"], ".3f"),
                "1 (ref)" if ref else fmt(rat and rat["rank0_extra_mem_ratio"], ".2f"),
            ]
        )
    return markdown_table(headers, rows)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    names = list(ok)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(9, 2.5 * len(names) + 4), 4.5))
    x = list(range(len(names)))
    colors = ["tab:blue" if n == "flatshard" else "tab:gray" for n in names]
    med = [ok[n]["gather_s"] for n in names]
    ax_t.bar(x, med, 0.6, color=colors)
    for i, n in enumerate(names):
        ax_t.plot(
            [i] * len(ok[n]["gather_s_per_repeat_per_rank"][0]),
            ok[n]["gather_s_per_repeat_per_rank"][0],
            "k.",
        )
        ax_t.annotate(f"{med[i]:.3f}s", (i, med[i]), ha="center", va="bottom", fontsize=8)
    peers = [ok[n]["gather_s"] for n in names if n != "flatshard"]
    if "flatshard" in ok and peers:
        target = TARGET_TIME_RATIO * min(peers)
        ax_t.axhline(
            target, color="tab:red", ls="--", lw=1, label=f"target: {TARGET_TIME_RATIO}x the fastest FSDP"
        )
        ax_t.legend(fontsize=7, loc="lower right")
    ax_t.set_ylabel("seconds, lower is better")
    ax_t.set_title("gather full model + optim state (rank 0 median; dots: repeats)", fontsize=9)
    w = 0.27
    r0 = [ok[n]["extra_peak_mib_per_rank"][0] for n in names]
    r1 = [ok[n]["extra_peak_mib_per_rank"][-1] for n in names]
    st = [ok[n]["full_state_bytes"] / MIB for n in names]
    ax_m.bar([i - w for i in x], r0, w, color="C0", label="rank 0 extra peak RSS")
    ax_m.bar(x, r1, w, color="C1", label="rank 1 extra peak RSS")
    ax_m.bar([i + w for i in x], st, w, color="C2", alpha=0.6, label="full state size")
    ax_m.set_ylabel("MiB")
    ax_m.set_title("extra peak memory during the gather", fontsize=9)
    ax_m.legend(fontsize=7)
    for ax in (ax_t, ax_m):
        ax.set_xticks(x)
        ax.set_xticklabels(
            [
                n + ("\n(offload_to_cpu=False)" if ok[n].get("fsdp1_offload_to_cpu") is False else "")
                for n in names
            ]
        )
        ax.grid(axis="y", alpha=0.3)
    failed = [k for k, v in results.items() if v.get("status") != "ok"]
    if failed:
        title += f"  [failed: {', '.join(failed)}]"
    save_figure(fig, path, title)


def _reference_param_names(cfg: dict[str, Any]) -> list[str]:
    """``named_parameters()`` of the unsharded GPT, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return [n for n, _ in model.named_parameters()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-large", help="model preset")
    for field in MODEL_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument(
        "--contenders",
        default=",".join(ALL_CONTENDERS),
        help=f"comma-separated, run in this order; choices: {', '.join(ALL_CONTENDERS)}",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed gathers per contender (median reported)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed gathers per contender before the timed ones"
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--memory-method",
        choices=["auto", "vmhwm", "sampler"],
        default="auto",
        help="auto: VmHWM after a clear_refs reset if permitted, else a 5 ms VmRSS sampler thread",
    )
    p.add_argument(
        "--fsdp1-offload",
        choices=["auto", "on", "off"],
        default="auto",
        help="FSDP1 offload_to_cpu; auto: True, and if that run fails (torch 2.13 segfaults on CPU),\n"
        "run FSDP1 again in fresh processes with False",
    )
    p.add_argument(
        "--no-malloc-trim",
        dest="malloc_trim",
        action="store_false",
        help="do not call glibc malloc_trim(0) before each gather (then RSS before a gather includes\n"
        "freed-but-retained heap memory that the gather reuses, and the extra memory reads low)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a contender may run")
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes next to it")
    p.add_argument(
        "--tmpdir",
        type=Path,
        default=None,
        help="where the checkpoints are written (default: a new temp dir)",
    )
    p.add_argument("--keep-files", action="store_true", help="do not delete the saved checkpoints")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(PRESETS[args.preset])
    overrides = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    cfg.update(overrides)
    if cfg["device"] != "cpu":
        raise SystemExit("this benchmark runs on CPU (gloo) only")
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    cfg.update(
        preset=args.preset,
        overrides=overrides,
        world_size=args.world_size,
        seed=args.seed,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        memory_method=args.memory_method,
        malloc_trim=args.malloc_trim,
        fsdp1_offload=args.fsdp1_offload,
        optimizer="AdamW(lr=1e-4), other defaults; one training step before the gathers",
        precision="fp32",
    )
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join(ALL_CONTENDERS)}")
    ws = cfg["world_size"]
    out = args.out or default_out(f"checkpoint_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tmpdir is not None:
        args.tmpdir.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix="flatshard_ckpt_bench_", dir=args.tmpdir))
    cfg["tmpdir"] = str(tmpdir)

    report: dict[str, Any] = {
        "benchmark": "checkpoint",
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(cfg),
        "config": cfg,
        "contenders": contenders,
        "targets": {
            "flatshard_gather_time_over_each_fsdp": f"<= {TARGET_TIME_RATIO}",
            "flatshard_rank0_extra_memory_over_full_state": f"<= {TARGET_MEM_OVER_STATE}",
        },
        "results": {},
        "ratios": {},
    }
    print(
        f"preset {args.preset}: d_model={cfg['d_model']} n_layer={cfg['n_layer']} n_head={cfg['n_head']} "
        f"vocab={cfg['vocab_size']} seq={cfg['seq_len']} | {ws} ranks, gloo, cpu, fp32, "
        f"{cfg['threads']} thread(s)/rank | repeats {cfg['repeats']} | checkpoints in {tmpdir}",
        flush=True,
    )
    param_names: list[str] | None = None
    try:
        for name in contenders:
            t0 = time.perf_counter()
            print(f"{name}: {DESCRIPTIONS[name]} ...", flush=True)
            attempts = [cfg]
            if name == "fsdp1" and cfg["fsdp1_offload"] == "auto":
                attempts = [dict(cfg, fsdp1_offload="on"), dict(cfg, fsdp1_offload="off")]
            earlier_errors: list[str] = []
            res = None
            for attempt in attempts:
                try:
                    per_rank = spawn_ranks(
                        run_contender, ws, name, attempt, backend="gloo", timeout=args.timeout
                    )
                    res = summarize(name, per_rank)
                    break
                except Exception as err:  # record it, then the fallback or the next contender
                    msg = f"{type(err).__name__}: {err}"
                    crash = _crash_report(attempt, name, ws)
                    if crash:
                        msg = f"{crash}\n{msg}"
                    earlier_errors.append(msg)
                    more = " (retrying with offload_to_cpu=False)" if attempt is not attempts[-1] else ""
                    print(
                        f"    FAILED after {time.perf_counter() - t0:.1f}s{more}:\n{indent(msg)}", flush=True
                    )
            if res is None:
                report["results"][name] = {
                    "status": "failed",
                    "description": DESCRIPTIONS[name],
                    "error": earlier_errors[-1],
                    "earlier_errors": earlier_errors[:-1],
                }
                continue
            if name == "fsdp1":
                res["fsdp1_offload_requested"] = cfg["fsdp1_offload"]
                res["fsdp1_offload_error"] = earlier_errors[-1] if earlier_errors else None
            if name == "flatshard" or param_names is None:
                param_names = per_rank[0]["param_names"]
            res["loadavg_after_run"] = [round(x, 2) for x in os.getloadavg()]
            report["results"][name] = res
            print(
                f"    done in {time.perf_counter() - t0:.1f}s: gather {res['gather_s']:.3f}s "
                f"(repeats {res['gather_s_per_repeat_per_rank'][0]}), extra peak "
                f"{res['extra_peak_mib_per_rank']} MiB, state {res['full_state_bytes'] / MIB:.0f} MiB, "
                f"save {res['save_s']:.2f}s, load {res['load_s']:.3f}s"
                + (f", set_state_dict {res['set_state_dict_s']:.3f}s" if "set_state_dict_s" in res else ""),
                flush=True,
            )
        reference_names = _reference_param_names(cfg)
        try:
            report["correctness"] = check_correctness(
                contenders, tmpdir, param_names or reference_names, reference_names
            )
        except Exception:
            report["correctness"] = {"all_equal": None, "error": traceback.format_exc()}
    finally:
        if args.keep_files:
            print(f"checkpoints kept in {tmpdir}")
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)

    report["ratios"] = compute_ratios(report["results"])
    report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    notes = []
    results = report["results"]
    methods = {r.get("memory_method") for r in results.values() if r.get("status") == "ok"}
    for m in sorted(methods):
        notes.append(
            {
                "vmhwm": "memory: VmHWM after resetting it with `echo 5 > /proc/self/clear_refs` right "
                "before each gather, minus VmRSS before it",
                "sampler": "memory: max VmRSS sampled every 5 ms by a background thread minus VmRSS before "
                "the gather (short spikes can be missed); used because /proc/self/clear_refs is not "
                "writable or --memory-method sampler was given",
            }[m]
        )
    f1 = results.get("fsdp1", {})
    if f1.get("status") == "ok" and not f1.get("fsdp1_offload_to_cpu"):
        err = (f1.get("fsdp1_offload_error") or "").strip().splitlines()
        notes.append(
            "fsdp1 ran with offload_to_cpu=False (model and optimizer configs)"
            + (
                f" because the run with offload_to_cpu=True failed: {err[0][:300] if err else '?'}"
                if f1.get("fsdp1_offload_error")
                else ""
            )
            + "; on CPU the gathered tensors are CPU tensors either way"
        )
    fs = results.get("flatshard", {})
    if fs.get("status") == "ok":
        notes.append(
            "save: flatshard uses atomic_save (temp file + fsync + rename), the peers plain torch.save; "
            f"flatshard's state with plain torch.save took {fs['save_plain_torch_save_s']:.2f}s"
        )
        if fs.get("roundtrip_equal") is False:
            notes.append("flatshard: gathering after set_state_dict did NOT give back the loaded state")
    sizes = {n: r for n, r in results.items() if r.get("status") == "ok"}
    if len({r["full_state_bytes"] for r in sizes.values()}) > 1:
        notes.append(
            "full state sizes differ (storages counted once / summed over every tensor entry): "
            + ", ".join(
                f"{n} {r['full_state_bytes'] / MIB:.0f} / {r['full_state_bytes_all_entries'] / MIB:.0f} MiB"
                for n, r in sizes.items()
            )
            + "; a contender whose two sizes are equal returns separate copies of tensors that the model "
            "shares (the tied embedding / LM-head weight)"
        )
    corr = report.get("correctness", {})
    if corr.get("all_equal") is False:
        notes.append("correctness: the contenders' states differ (see `correctness` in the JSON)")
    busy = [
        (n, r["loadavg_after_run"][0])
        for n, r in results.items()
        if r.get("status") == "ok" and r["loadavg_after_run"][0] > ws + 0.75
    ]
    for n, la in busy:
        notes.append(f"{n}: 1-min load average {la:.1f} after its run: other processes competed for the CPUs")
    report["notes"] = notes

    table = format_table(results, report["ratios"])
    report["table"] = table
    print()
    print(table)
    if report["ratios"]:
        print("\nratios (flatshard / peer; < 1 means flatshard is faster or needs less memory):")
        for key, r in report["ratios"].items():
            print(
                f"  {key:<17} gather time x{r['gather_time_ratio']:.3f} "
                f"(target <= {TARGET_TIME_RATIO}: {'met' if r['meets_time_target'] else 'NOT met'}), "
                f"rank-0 extra memory x{fmt(r['rank0_extra_mem_ratio'], '.2f')}, "
                f"rank-1 extra memory x{fmt(r['rank1_extra_mem_ratio'], '.2f')}"
            )
    for name, r in results.items():
        if r.get("status") == "ok":
            print(
                f"  {name:<17} rank-0 extra memory / full state size = {r['rank0_extra_over_state']:.2f} "
                f"(target <= {TARGET_MEM_OVER_STATE}: {'met' if r['meets_memory_target'] else 'NOT met'})"
            )
    if corr:
        print(
            "\ncorrectness (model keys + tensors and AdamW exp_avg, torch.equal, "
            f"vs {corr.get('reference')}): {corr.get('all_equal')}"
        )
        for pair, e in corr.get("pairs", {}).items():
            print(
                f"  {pair}: model keys {e['model_same_keys']}, model tensors {e['model_tensors_equal']}, "
                f"exp_avg {e['exp_avg_equal']}, exp_avg_sq {e['exp_avg_sq_equal']}, steps {e['step_values']}"
            )
    for n in notes:
        print("note:", n)
    write_json(out, report, default=str)
    png = out.with_suffix(".png")
    title = (
        f"checkpoint {args.preset}: d{cfg['d_model']} L{cfg['n_layer']} V{cfg['vocab_size']}, "
        f"{ws} ranks gloo CPU fp32, torch {torch.__version__}, {report['date'][:10]}"
    )
    try:
        plot(results, png, title)
    except Exception as err:  # the JSON is the primary output
        print(f"plot failed: {type(err).__name__}: {err}")
    else:
        print(f"\nwrote {out} and {png}")
    ok = [r for r in results.values() if r.get("status") == "ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
