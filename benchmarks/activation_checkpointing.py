"""Activation memory and step time with and without ``activation_checkpointing_policy={Block}``.

Both runs use flatshard FULL_SHARD with one unit per ``Block`` on ``--world-size`` ranks (gloo, CPU), the same
GPT (``examples/gpt/model.py``), weights and batches. Per rank it reports:

* **saved activations**: bytes autograd keeps for backward after one forward (distinct storages, the
  gathered parameter buffers excluded), counted with ``torch.autograd.graph.saved_tensors_hooks``;
* **peak RSS** over the training steps (``VmHWM``, reset with ``clear_refs`` after the model is built);
* **median step time** over ``--steps`` steps after one warm-up step;
* the losses of both runs, which must agree (recomputation changes nothing numerically).

    python benchmarks/activation_checkpointing.py --preset cpu-small

Writes ``docs/bench/activation_checkpointing_<preset>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_measure import MIB, proc_status_kib, reset_peak_rss
from bench_model import PRESETS, Block, build_model, make_batches
from bench_output import default_out, machine_info, utc_now, write_json

import flatshard
from flatshard.testing import spawn
from flatshard.testing.activations import saved_activation_bytes


def run(rank: int, world: int, cfg: dict[str, Any], checkpointing: bool) -> dict[str, Any]:
    torch.set_num_threads(cfg["threads"])
    model = build_model(cfg)
    flatshard.shard(
        model, auto_wrap_policy={Block}, activation_checkpointing_policy={Block} if checkpointing else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(dict(cfg, warmup=1), rank, world, torch.device("cpu"))
    saved, _ = saved_activation_bytes(model, lambda: model(batches[0][0]))
    out: dict[str, Any] = {"saved_activation_bytes": saved}
    times, losses = [], []
    dist.barrier()
    reset = reset_peak_rss()  # from here on: the training steps only
    for step, (idx, tgt) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(idx).view(-1, cfg["vocab_size"]), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if step >= 1:
            times.append(elapsed)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    peak = proc_status_kib("VmHWM")["VmHWM"] if reset else None
    out.update(step_s=statistics.median(times), peak_rss_mib=peak / 1024 if peak else None)
    out["losses"] = losses
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset", choices=[k for k in PRESETS if PRESETS[k]["device"] == "cpu"], default="cpu-small"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = dict(PRESETS[args.preset], steps=args.steps, threads=args.threads, seed=args.seed)
    started = utc_now()
    results = {}
    for name, on in (("without", False), ("with", True)):
        per_rank = spawn(run, args.world_size, cfg, on, timeout=1800)
        results[name] = per_rank
        r0 = per_rank[0]
        print(
            f"{name:>7} activation checkpointing: saved activations {r0['saved_activation_bytes'] / MIB:.1f} MiB, "
            f"peak RSS {r0['peak_rss_mib']} MiB, step {r0['step_s']:.3f} s",
            flush=True,
        )
    w, c = results["without"][0], results["with"][0]
    summary = {
        "saved_activations_ratio": c["saved_activation_bytes"] / w["saved_activation_bytes"],
        "step_time_ratio": c["step_s"] / w["step_s"],
        "peak_rss_ratio": (c["peak_rss_mib"] / w["peak_rss_mib"])
        if c["peak_rss_mib"] and w["peak_rss_mib"]
        else None,
        "max_loss_diff": max(abs(a - b) for a, b in zip(w["losses"], c["losses"], strict=True)),
    }
    print(json.dumps(summary, indent=2))
    out = args.out or default_out(f"activation_checkpointing_{args.preset}.json")
    write_json(
        out,
        {
            "benchmark": "activation_checkpointing",
            "date": started,
            "command": "python benchmarks/activation_checkpointing.py " + " ".join(argv or sys.argv[1:]),
            "machine": machine_info(cfg),
            "config": dict(cfg, world_size=args.world_size),
            "results": results,
            "summary": summary,
        },
        newline=False,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
