"""A full checkpoint in the user's sequence: train, write one file at once, then resume in fresh processes.

Each contender trains ``--steps`` AdamW steps, then right away (no ``gc``, trim or pause) writes the full model and
optimizer state to one file: ``flatshard.save_checkpoint`` (streamed unit by unit, fsync, rename); the peers gather
the full state their own way (FSDP1 ``FULL_STATE_DICT``, FSDP2 ``get_state_dict(full_state_dict=True)``, DDP the
replica's) and ``torch.save`` it on rank 0 (their fsync is timed apart). Fresh ranks then build the model again and
load the file (``flatshard.load_checkpoint``; the peers ``torch.load(mmap=True)`` and set the state). Rank 0 polls
every rank's private memory every 5 ms. Every file is checked against flatshard's before anything is compared.
``--gathers K`` adds labelled rows: K more full-state gathers after the write, warm, each after ``gc.collect()``
(the sharded contenders: DDP's replica needs no gather).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import contenders as reg
from ..measure import MemoryPoller, malloc_trim, median, shmem_kib, touch_host_memory
from ..model import build_model, make_batches
from ..report import Column, Panel
from ..schema import Row
from . import add_gpt_arguments, check_against, failed, gpt_config, interleaved

PRESETS = ("cpu-large", "cpu-small", "tiny")
CONTENDERS = ("flatshard", "fsdp1", "fsdp2", "ddp")
DEFAULT_CONTENDERS = CONTENDERS
RATIOS = (
    "write_s",
    "write_fsync_s",
    "write_peak_mib",
    "load_s",
    "load_increase_mib",
    "gather_s",
    "node_peak_mib",
)
COLUMNS = [
    Column("training peak MiB r0", "training_peak_mib", ".0f"),
    Column("write peak MiB r0", "write_peak_mib", ".0f"),
    Column("write s", "write_s", ".2f"),
    Column("with fsync s", "write_fsync_s", ".2f"),
    Column("gather s", "gather_s", ".3f"),
    Column("node peak MiB", "node_peak_mib", ".0f"),
    Column("load: increase MiB/rank", "load_increase_mib", ".0f"),
    Column("load s", "load_s", ".2f"),
    Column("file MiB", "file_mib", ".0f"),
    Column("flatshard ÷ this: write s", "÷write_fsync_s", ".2f"),
    Column("load s", "÷load_s", ".2f"),
]
PANELS = [
    Panel("rank 0 private MiB", ("training_peak_mib", "write_peak_mib")),
    Panel("seconds", ("write_fsync_s", "load_s", "gather_s")),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_gpt_arguments(p, steps=6, warmup=0)
    p.add_argument(
        "--gathers", type=int, default=0, help="extra rows: warm full-state gathers after the write"
    )
    p.add_argument(
        "--malloc-trim", action="store_true", help="malloc_trim(0) before each warm gather (labelled)"
    )
    p.add_argument("--touch-host-mib", type=int, default=0, help="touch and free N MiB before each contender")
    p.add_argument(
        "--folder", type=Path, default=None, help="where the files go (default: a temporary folder)"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    cfg = gpt_config(args)
    cfg.update(device="cpu", precision="fp32", gathers=args.gathers, malloc_trim=args.malloc_trim)
    cfg.update(touch_host_mib=args.touch_host_mib, folder=args.folder)
    variant = "_".join(
        p
        for p in (
            "touched" if args.touch_host_mib else "",
            f"w{cfg['world_size']}" if cfg["world_size"] != 2 else "",
        )
        if p
    )
    return cfg, variant


def _model(name: str, cfg: dict[str, Any], rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = reg.wrap(name, build_model(cfg), cfg, reg.rank_device(cfg, rank))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_rank(rank: int, world: int, name: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    pids, shmem = (pids if rank == 0 else []), shmem_kib()
    model, opt = _model(name, cfg, rank)
    out: dict[str, Any] = {}
    with MemoryPoller(pids, shmem) as training:
        for idx, tgt in make_batches(cfg, rank, world, torch.device("cpu"), cfg["steps"]):
            F.cross_entropy(model(idx).view(-1, cfg["vocab_size"]), tgt.view(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    dist.barrier()
    with MemoryPoller(pids, shmem) as saving:
        t0 = time.perf_counter()
        if name == "flatshard":
            import flatshard

            flatshard.save_checkpoint(path, model, opt)
        else:
            msd, osd = reg.full_state(name, model, opt)
            out["gather_s"] = time.perf_counter() - t0
            if rank == 0:
                torch.save({"state_dict": msd, "optimizer_states": [osd]}, path)
            del msd, osd
        dist.barrier()
        out["write_s"] = time.perf_counter() - t0
    if rank == 0 and name != "flatshard":  # flatshard's save syncs before it returns; torch.save does not
        t0 = time.perf_counter()
        _fsync(path)
        out["fsync_s"] = time.perf_counter() - t0
    out["gathers"] = []
    for _ in range(cfg["gathers"] if reg.get(name).family != "ddp" else 0):  # extra rows: warm gathers
        gc.collect()
        malloc_trim(cfg["malloc_trim"])
        dist.barrier()
        with MemoryPoller(pids, shmem) as gathering:
            t0 = time.perf_counter()
            state = reg.full_state(name, model, opt)
            out["gathers"].append({"s": time.perf_counter() - t0})
        del state
        if rank == 0:
            out["gathers"][-1].update(gathering.result())
    if rank == 0:
        out["training"], out["saving"] = training.result(), saving.result()
    return out


def resume_rank(rank: int, world: int, name: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    model, opt = _model(name, cfg, rank)
    for p in model.parameters():  # AdamW's state exists before a load, as in a resumed run: load into it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    with MemoryPoller(pids if rank == 0 else [], shmem_kib()) as loading:
        t0 = time.perf_counter()
        if name == "flatshard":
            import flatshard

            flatshard.load_checkpoint(path, model, opt)
        else:
            ckpt = torch.load(path, mmap=True, weights_only=True)
            reg.load_full_state(name, model, opt, ckpt["state_dict"], ckpt["optimizer_states"][0])
            del ckpt
        dist.barrier()
        out = {"load_s": time.perf_counter() - t0}
    if rank == 0:
        out["loading"] = loading.result()
    return out


def _once(name: str, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
    if cfg["touch_host_mib"]:
        print(
            f"    touched {cfg['touch_host_mib']} MiB in {touch_host_memory(cfg['touch_host_mib']):.1f}s",
            flush=True,
        )
    path = str(folder / f"{name}.ckpt")
    saved = reg.run_ranks(save_rank, cfg["world_size"], name, cfg, path, cfg=cfg)
    loaded = reg.run_ranks(resume_rank, cfg["world_size"], name, cfg, path, cfg=cfg)
    return {"save": saved, "load": loaded, "path": path, "file_mib": os.path.getsize(path) / 2**20}


def _rows(name: str, runs: list[dict[str, Any]], cfg: dict[str, Any]) -> list[Row]:
    """The user's sequence (medians over repeats; memory: the largest), and the warm gathers' row."""
    r0s = [run["save"][0] for run in runs]
    loads = [run["load"][0]["loading"] for run in runs]
    write = median([r["write_s"] for r in r0s]) or 0.0
    metrics: dict[str, Any] = {
        "training_peak_mib": max(r["training"]["private_peak_mib"][0] for r in r0s),
        "write_peak_mib": max(r["saving"]["private_peak_mib"][0] for r in r0s),
        "write_s": write,
        "write_fsync_s": write + (median([r.get("fsync_s", 0.0) for r in r0s]) or 0.0),
        "gather_s": median([r["gather_s"] for r in r0s]) if "gather_s" in r0s[0] else None,
        "node_peak_mib": max(r["saving"]["node_peak_mib"] for r in r0s),
        "load_increase_mib": [
            max(round(lo["private_peak_mib"][k] - lo["private_before_mib"][k], 1) for lo in loads)
            for k in range(cfg["world_size"])
        ],
        "load_s": median([run["load"][0]["load_s"] for run in runs]),
        "file_mib": runs[-1]["file_mib"],
    }
    rows = [Row(name=name, contender=name, metrics=metrics, runs=runs)]
    gathers = [g for r in r0s for g in r["gathers"]]
    if gathers:
        label = "warm gather" + (", malloc_trim first" if cfg["malloc_trim"] else "")
        warm = {
            "gather_s": median([g["s"] for g in gathers]),
            "gather_peak_mib": max(g["private_peak_mib"][0] for g in gathers),
            "node_peak_mib": max(g["node_peak_mib"] for g in gathers),
            "gather_extra_mib": max(g["private_peak_mib"][0] - g["private_before_mib"][0] for g in gathers),
        }
        rows.append(Row(name=f"{name} {label}", contender=name, label=label, metrics=warm, runs=gathers))
    return rows


def _same_file(row: Row, ref: Row) -> str | None:
    """Where ``row``'s file differs from ``ref``'s: the model's tensors, then the optimizer's state by position."""
    mine, theirs = (torch.load(r.runs[-1]["path"], mmap=True, weights_only=True) for r in (row, ref))
    if sorted(mine["state_dict"]) != sorted(theirs["state_dict"]):
        return "state_dict keys differ"
    for key, value in theirs["state_dict"].items():
        if not torch.allclose(mine["state_dict"][key].float(), value.float(), atol=1e-5, rtol=1e-5):
            return f"state_dict[{key!r}] differs"

    def ordered(ckpt: dict[str, Any]) -> list[dict[str, Any]]:  # keyed by index (flatshard, DDP) or by name
        osd = ckpt["optimizer_states"][0]
        return [osd["state"].get(p, {}) for g in osd["param_groups"] for p in g["params"]]

    for i, (a, b) in enumerate(zip(ordered(theirs), ordered(mine), strict=True)):
        for k, v in a.items():
            if not torch.allclose(
                torch.as_tensor(b[k]).float(), torch.as_tensor(v).float(), atol=1e-5, rtol=1e-4
            ):
                return f"optimizer state {k} of parameter {i} differs"
    return None


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    with tempfile.TemporaryDirectory(dir=cfg["folder"], prefix="flatshard_bench_checkpoint_") as folder:
        runs, errors = interleaved(contenders, cfg["repeats"], lambda c: _once(c, cfg, Path(folder)))
        rows = [
            r for c in contenders for r in ([failed(c, errors[c])] if c in errors else _rows(c, runs[c], cfg))
        ]
        users = [r for r in rows if not r.label]
        reference = next((r for r in users if r.name == "flatshard" and r.ok), None)
        check_against(users, reference, _same_file)
    for r in rows:  # the warm rows share their contender's check
        if r.label and r.ok:
            r.check = users[[u.contender for u in users].index(r.contender)].check
            r.status = "ok" if r.check.get("ok", True) else "check failed"
    notes = ["private memory: RssAnon + RssFile per rank; node: their sum + Shmem growth (shared pages once)"]
    if cfg["touch_host_mib"]:
        notes.append(
            f"{cfg['touch_host_mib']} MiB touched and freed before each contender (a VM's first touch)"
        )
    return rows, notes


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    """flatshard over each peer, the user's sequence and the warm gathers each with its own kind."""
    ref = {r.label: r.name for r in rows if r.contender == "flatshard"}
    return [(ref[r.label], r.name) for r in rows if r.contender != "flatshard" and r.label in ref]
