"""How long a sharded save blocks training: ``async_save`` off vs on, and the step time while one is written.

Both modes run in the same freshly spawned ranks (``--world-size``, default 2, gloo on CPU), on the same GPT
(``examples/gpt/model.py``, the ``step_time.py`` preset; one unit per ``Block``) with ``AdamW`` state. Each mode
saves ``--saves`` times to a sharded directory (the same path, replaced each time) with ``--steps-between`` training
steps after every save, and measures on rank 0:

* **blocked per save**: wall time of the save call, after a barrier, until every rank has returned (a barrier):
  synchronous ``flatshard.checkpoint.write_sharded_checkpoint``, or ``AsyncSaver.save`` (wait for the previous
  save, stage a CPU copy, plan, start the thread);
* **step time while writing**: the median time of the training steps that started while the background write
  was still going (async), against the median step time with no save in flight (steps after the write
  finished, and the steps of the synchronous mode).

    python benchmarks/async_save.py --preset cpu-small --saves 2      # smoke run
    python benchmarks/async_save.py                                   # cpu-large: 203M parameters

Prints a markdown table and writes ``docs/bench/async_save_<preset>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_contenders import barrier, spawn_ranks
from bench_model import PRESETS, build_model, make_batches
from bench_output import default_out, machine_info, markdown_table, utc_now, write_json


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    start = time.perf_counter()
    idx, target = batch
    logits = model(idx)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(rank: int, world: int, cfg: dict[str, Any], directory: str) -> dict[str, Any]:
    import flatshard
    from flatshard.checkpoint import AsyncSaver, write_sharded_checkpoint
    from flatshard.engine import sharded_model_state_dict, sharded_optim_state_dict

    torch.set_num_threads(cfg["threads"])
    device = torch.device("cpu")
    model = build_model(cfg)
    block = type(model.blocks[0]) if hasattr(model, "blocks") else None
    flatshard.shard(model, auto_wrap_policy={block} if block is not None else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(cfg, rank, world, device)
    _train_step(model, opt, batches[0])  # optimizer state exists from here on
    path = os.path.join(directory, "ckpt")

    def checkpoint() -> dict[str, Any]:
        return {
            "state_dict": sharded_model_state_dict(model),
            "optimizer_states": [sharded_optim_state_dict(model, opt)],
            "step": 0,
        }

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        saver = AsyncSaver()
        blocked: list[float] = []
        idle_steps: list[float] = []
        busy_steps: list[float] = []
        for i in range(cfg["saves"]):
            barrier(device)
            start = time.perf_counter()
            if mode == "sync":
                write_sharded_checkpoint(checkpoint(), path)
            else:
                saver.save(checkpoint(), path)
            barrier(device)
            blocked.append(time.perf_counter() - start)
            for k in range(cfg["steps_between"]):
                writing = saver.writing  # the background write overlaps this step (at least its start)
                seconds = _train_step(model, opt, batches[(i * cfg["steps_between"] + k) % len(batches)])
                (busy_steps if writing else idle_steps).append(seconds)
            saver.wait(collective=True)
        out[mode] = {"blocked_s": blocked, "idle_step_s": idle_steps, "busy_step_s": busy_steps}
    dist.barrier()
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--preset", choices=sorted(k for k in PRESETS if k.startswith("cpu")), default="cpu-large")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--dir", default=None, help="where to write the checkpoints (default: a temporary directory)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = dict(PRESETS[args.preset], seed=0, warmup=1, steps=args.steps_between, saves=args.saves)
    cfg.update(steps_between=args.steps_between, threads=args.threads, precision="32-true")
    directory = tempfile.mkdtemp(prefix="flatshard-async-", dir=args.dir)
    try:
        ranks = spawn_ranks(run, args.world_size, cfg, directory, backend="gloo", timeout=1800.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    r0 = ranks[0]
    rows = []
    for mode in ("sync", "async"):
        m = r0[mode]
        rows.append(
            [
                mode,
                f"{_median(m['blocked_s']):.3f}",
                ", ".join(f"{s:.2f}" for s in m["blocked_s"]),
                f"{_median(m['idle_step_s']):.3f}" if m["idle_step_s"] else "-",
                f"{_median(m['busy_step_s']):.3f} ({len(m['busy_step_s'])})" if m["busy_step_s"] else "-",
            ]
        )
    headers = [
        "mode",
        "blocked per save (median s)",
        "each save (s)",
        "step, no save in flight (s)",
        "step while writing (s, steps)",
    ]
    out = args.out or default_out(f"async_save_{args.preset}.json")
    write_json(Path(out), {"date": utc_now(), "config": cfg, "machine": machine_info(cfg), "ranks": ranks})
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
