"""How long a sharded save blocks training, with ``async_save`` off and on, and the steps while one is written.

In the same fresh ranks, flatshard (one unit per ``Block``, AdamW state) saves ``--saves`` times to one sharded
directory with ``--steps-between`` training steps after each save: first with ``write_sharded_checkpoint``
(synchronous), then with ``flatshard.checkpoint.AsyncSaver`` (what ``async_save=True`` does). Rank 0 reports the
time a save blocks training (barrier to barrier), the median step with no save in flight, and the median of the
steps that started while a background write was still going.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import contenders as reg
from ..measure import median
from ..model import build_model, make_batches
from ..report import Column, Panel
from ..schema import Row
from . import add_gpt_arguments, failed, gpt_config, interleaved

PRESETS = ("cpu-large", "cpu-small", "tiny")
CONTENDERS = ("flatshard",)
DEFAULT_CONTENDERS = CONTENDERS
MODES = ("sync", "async")
RATIOS = ("blocked_s", "busy_step_s")
REFERENCE = "flatshard sync"
COLUMNS = [
    Column("blocked per save s", "blocked_s", ".3f"),
    Column("each save s", "blocked_each_s", ".2f"),
    Column("step, no save in flight s", "idle_step_s", ".3f"),
    Column("step while writing s", "busy_step_s", ".3f"),
    Column("steps while writing", "busy_steps", "d"),
]
PANELS = [Panel("seconds", ("blocked_s", "idle_step_s", "busy_step_s"))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_gpt_arguments(p, steps=8, warmup=1)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument(
        "--folder", type=Path, default=None, help="where the checkpoints go (default: a temporary one)"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    cfg = gpt_config(args)  # --steps: training steps between two saves
    cfg.update(device="cpu", precision="fp32", saves=args.saves, folder=args.folder)
    return cfg, ""


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    t0 = time.perf_counter()
    logits = model(batch[0])
    F.cross_entropy(logits.view(-1, logits.size(-1)), batch[1].view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def save_rank(rank: int, world: int, cfg: dict[str, Any], directory: str) -> dict[str, Any]:
    from flatshard.checkpoint import AsyncSaver, write_sharded_checkpoint
    from flatshard.engine import sharded_model_state_dict, sharded_optim_state_dict

    device = reg.rank_device(cfg, rank)
    model = reg.wrap("flatshard", build_model(cfg), cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(cfg, rank, world, device, cfg["saves"] * cfg["steps"])
    for batch in batches[: max(1, cfg["warmup"])]:  # the optimizer state exists from here on
        _step(model, opt, batch)
    path = os.path.join(directory, "ckpt")
    out: dict[str, Any] = {}
    for mode in MODES:
        saver, blocked, idle, busy = AsyncSaver(), [], [], []
        for i in range(cfg["saves"]):
            state = {
                "state_dict": sharded_model_state_dict(model),
                "optimizer_states": [sharded_optim_state_dict(model, opt)],
            }
            reg.barrier(device)
            t0 = time.perf_counter()
            if mode == "sync":
                write_sharded_checkpoint(state, path)
            else:
                saver.save(state, path)
            reg.barrier(device)
            blocked.append(time.perf_counter() - t0)
            for k in range(cfg["steps"]):
                writing = saver.writing  # the background write overlaps (at least the start of) this step
                (busy if writing else idle).append(_step(model, opt, batches[i * cfg["steps"] + k]))
            saver.wait(collective=True)
        out[mode] = {"blocked_s": blocked, "idle_step_s": idle, "busy_step_s": busy}
    return out


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    folder = tempfile.mkdtemp(prefix="flatshard_bench_async_", dir=cfg["folder"])
    try:
        runs, errors = interleaved(
            contenders,
            cfg["repeats"],
            lambda c: reg.run_ranks(save_rank, cfg["world_size"], cfg, folder, cfg=cfg),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if "flatshard" in errors:
        return [failed("flatshard", errors["flatshard"], mode) for mode in MODES], []
    rows = []
    for mode in MODES:
        r0 = [run[0][mode] for run in runs["flatshard"]]
        metrics = {
            "blocked_s": median([s for r in r0 for s in r["blocked_s"]]),
            "blocked_each_s": [round(s, 3) for r in r0 for s in r["blocked_s"]],
            "idle_step_s": median([s for r in r0 for s in r["idle_step_s"]]),
            "busy_step_s": median([s for r in r0 for s in r["busy_step_s"]]),
            "busy_steps": sum(len(r["busy_step_s"]) for r in r0),
        }
        rows.append(
            Row(name=f"flatshard {mode}", contender="flatshard", label=mode, metrics=metrics, runs=r0)
        )
    return rows, ["the same ranks save synchronously first, then asynchronously"]


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    return [("flatshard async", "flatshard sync")]
