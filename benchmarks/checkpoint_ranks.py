"""What runs inside the ranks of ``checkpoint.py``: each contender's model (flatshard, FSDP1, FSDP2) trained a
step, then its full state gathered cold and warm, timed and measured, saved and checked (see ``checkpoint.py``
for what is compared and why)."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_checks import (
    fault_log_path,
    model_state_equal,
    optim_entry_equal,
)
from bench_contenders import barrier
from bench_measure import (
    MemoryPoller,
    PeakRSS,
    malloc_trim,
    mib,
    reset_peak_rss,
    shmem_kib,
    smaps_private_kib,
    tensor_bytes,
)
from bench_model import Block, build_model, make_batches

# ----------------------------------------------------------------------------------------------------------
# Helpers used inside the ranks
# ----------------------------------------------------------------------------------------------------------


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


def run_contender(rank: int, world_size: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank of a fresh process group; returns this rank's measurements (small, picklable)."""
    torch.set_num_threads(cfg["threads"])
    # A hard crash (segfault) leaves no Python traceback: faulthandler writes one where the driver finds it.
    fault_log = open(fault_log_path(cfg, name, rank), "w")  # stays open for the process lifetime
    faulthandler.enable(file=fault_log)
    device = torch.device("cpu")
    info: dict[str, Any] = {"rank": rank}
    t_setup = time.perf_counter()
    if rank == 0:  # before anything of this contender exists: the node total counts Shmem growth from here
        cfg["shmem_base_kib"] = shmem_kib()
    model = build_model(cfg)
    info["num_params"] = sum(p.numel() for p in model.parameters())  # tied weight counted once
    model = _shard(name, model, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Names in the order the optimizer numbers its parameters (flatshard's state is keyed by that index).
    info["param_names"] = [n for n, _ in model.named_parameters()] if rank == 0 else None

    # The user's sequence: training steps, then the first gather at once (nothing in between).
    for idx, tgt in make_batches(dict(cfg, warmup=0, steps=cfg["train_steps"]), rank, world_size, device):
        loss = F.cross_entropy(model(idx).view(-1, cfg["vocab_size"]), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    dist.all_reduce(loss)
    info["loss"] = loss.item() / world_size
    if name == "fsdp1":
        info["fsdp1_offload_to_cpu"] = cfg["fsdp1_offload"] == "on"
    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    method = cfg["memory_method"]
    if method == "auto":
        method = "vmhwm" if reset_peak_rss() else "sampler"
    info["memory_method"] = method
    info["setup_s"] = time.perf_counter() - t_setup

    def measure(first: bool = False) -> tuple[dict[str, Any], Any, Any]:
        """One gather: time, VmHWM extra, and (rank 0) every rank's private memory and the node total. The
        first follows training directly unless ``--malloc-trim`` (a labelled variant); warm repeats follow a
        ``gc.collect()`` that frees the previous result."""
        if not first:
            gc.collect()
        malloc_trim(cfg["malloc_trim"])
        m: dict[str, Any] = {"smaps_private_before_mib": mib(smaps_private_kib())}
        poller = MemoryPoller(pids, cfg["shmem_base_kib"]) if rank == 0 else contextlib.nullcontext()
        barrier(device)
        with PeakRSS(method) as probe, poller:
            t0 = time.perf_counter()
            msd, osd = _gather(name, model, opt, info)
            m["s"] = time.perf_counter() - t0
        m["smaps_private_after_mib"] = mib(smaps_private_kib())
        m["hwm_extra_mib"], m["retained_mib"] = probe.extra_mib, probe.retained_mib
        if isinstance(poller, MemoryPoller):
            m.update(poller.result())
        return m, msd, osd

    cold, msd, osd = measure(first=True)  # right after training, nothing gathered before it
    info["cold"] = cold
    del msd, osd
    for _ in range(cfg["warmup"]):  # untimed
        barrier(device)
        msd, osd = _gather(name, model, opt, info)
        del msd, osd
    info["warm"] = []
    msd = osd = None
    for _ in range(cfg["repeats"]):
        del msd, osd  # the previous result: freed before the next gather
        m, msd, osd = measure()
        info["warm"].append(m)
    if rank == 0:
        unique, total, count = tensor_bytes((msd, osd))
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
            info["roundtrip_equal"] = model_state_equal(loaded["model"], msd2)[0] and all(
                optim_entry_equal(loaded["optim"]["state"][k], osd2["state"].get(k))
                for k in loaded["optim"]["state"]
            )
        del msd2, osd2
    del loaded
    gc.collect()
    barrier(device)
    return info
