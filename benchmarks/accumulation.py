"""Gradient accumulation: reduce-scatter every micro-batch (``sharded``) against ``flatshard.no_sync``.

All contenders train the same GPT (``examples/gpt/model.py``) from the same seed on the same random token
micro-batches, ``--micro-batches`` micro-batches (of ``--micro-batch-size`` sequences per rank) per
optimizer step, on ``--world-size`` gloo ranks, each contender in freshly spawned processes:

* ``sharded``: flatshard FULL_SHARD, one unit per ``Block``; every backward reduce-scatters its gradients
  and the gradient shards accumulate (the default);
* ``no_sync``: the same, with the first ``micro-batches - 1`` micro-batches inside
  ``flatshard.no_sync(model)`` (unsharded gradients accumulate per unit) and the last one outside, which
  reduces everything once;
* ``ddp``: torch ``DistributedDataParallel`` with ``model.no_sync()`` for the first ``micro-batches - 1``
  micro-batches: what DDP does, as a reference.

Per contender: bytes sent into gradient reductions per optimizer step, median optimizer-step time, peak RSS
per rank during training, the losses, and the ratios no_sync / sharded.

    python benchmarks/accumulation.py --preset cpu-small

Writes ``docs/bench/accumulation_<preset>.json`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_measure import MIB, mib, proc_status_kib, reset_peak_rss
from bench_model import PRESETS, Block, build_model, make_batches
from bench_output import default_out, machine_info, utc_now, write_json

CONTENDERS = ("sharded", "no_sync", "ddp")
DESCRIPTIONS = {
    "sharded": "flatshard FULL_SHARD, unit per Block; reduce-scatter after every micro-batch",
    "no_sync": "flatshard FULL_SHARD, unit per Block; first M-1 micro-batches inside flatshard.no_sync",
    "ddp": "torch DistributedDataParallel; first M-1 micro-batches inside model.no_sync()",
}


def run(rank: int, world: int, cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """One contender on one rank of a fresh process group; returns this rank's measurements."""
    torch.set_num_threads(cfg["threads"])
    import flatshard
    from flatshard.engine.transport import comm

    m = cfg["micro_batches"]
    n_steps = cfg["warmup"] + cfg["steps"]
    t_setup = time.perf_counter()
    model_cfg = dict(cfg, batch_size=cfg["micro_batch_size"])
    model = build_model(model_cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weight once
    info: dict[str, Any] = {
        "num_params": sum(p.numel() for p in model.parameters()),
        "param_bytes": param_bytes,
    }
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        flatshard.shard(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    info["local_param_numel"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One global batch per micro-batch from a fixed seed; this rank takes its slice (same for everyone).
    batches = make_batches(dict(model_cfg, warmup=0, steps=n_steps * m), rank, world, torch.device("cpu"))
    vocab = cfg["vocab_size"]

    def accumulate_context(i: int) -> contextlib.AbstractContextManager[Any]:
        if name == "sharded" or i == m - 1:
            return contextlib.nullcontext()
        return flatshard.no_sync(model) if name == "no_sync" else model.no_sync()

    gc.collect()
    dist.barrier()
    info["setup_s"] = time.perf_counter() - t_setup
    info["rss_after_setup_mib"] = mib(proc_status_kib("VmRSS")["VmRSS"])
    info["hwm_reset"] = reset_peak_rss()  # from here on: the training steps only
    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[torch.Tensor] = []
    comm_per_step: list[dict[str, int]] = []
    for step in range(n_steps):
        comm.comm_stats.clear()
        dist.barrier()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        total = torch.zeros(())
        for i in range(m):
            idx, tgt = batches[step * m + i]
            with accumulate_context(i):
                loss = F.cross_entropy(model(idx).view(-1, vocab), tgt.view(-1)) / m
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        comm_per_step.append(dict(comm.comm_stats))
        losses.append(total)
        if step >= cfg["warmup"]:
            times.append(elapsed)
            # CPU time of this rank's process (all its threads): less sensitive to other load than wall time
            cpu_times.append(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
    st = proc_status_kib("VmHWM", "VmRSS")
    info["peak_rss_train_mib"] = mib(st["VmHWM"])
    info["rss_after_train_mib"] = mib(st["VmRSS"])
    info["peak_rss_increase_mib"] = round(st["VmHWM"] / 1024 - info["rss_after_setup_mib"], 1)
    info["step_times_s"] = times
    info["cpu_times_s"] = cpu_times
    info["comm_bytes_per_step"] = comm_per_step
    # gloo without a native reduce_scatter falls back to all_reduce (see flatshard.engine.transport.comm).
    info["reduce_scatter_fallback"] = sorted(comm._NO_NATIVE_REDUCE_SCATTER)
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)  # global mean loss per optimizer step (outside the timed region)
    info["losses"] = [round(v / world, 6) for v in stacked.tolist()]
    return info


def summarize(name: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Aggregate one contender's runs (``--repeats``; each a list of per-rank results)."""
    last = runs[-1]
    r0 = last[0]
    m = cfg["micro_batches"]
    if name == "ddp":
        synced = 1  # model.no_sync() for the first m-1 micro-batches: one all-reduce of every gradient
        reduce_bytes = synced * r0["param_bytes"]
        how = (
            f"computed, not counted: {synced} synced backward(s) per step x {r0['param_bytes']} parameter "
            "bytes (DDP all-reduces every gradient once per synced backward, in buckets)"
        )
        gather_bytes = 0
    else:
        timed = [s for run in runs for s in run[0]["comm_bytes_per_step"][cfg["warmup"] :]]
        per_step = [s.get("reduce_scatter", 0) + s.get("all_reduce", 0) for s in timed]
        if len(set(per_step)) != 1:
            raise RuntimeError(f"{name}: reduction bytes differ between steps: {per_step}")
        reduce_bytes = per_step[0]
        gather_bytes = timed[0].get("all_gather", 0)
        how = "counted: flatshard.engine.transport.comm.comm_stats reduce_scatter + all_reduce, rank 0"
    world = len(last)
    steps = [[t for run in runs for t in run[rank]["step_times_s"]] for rank in range(world)]
    cpu = [[t for run in runs for t in run[rank]["cpu_times_s"]] for rank in range(world)]
    slowest = [max(ts) for ts in zip(*steps, strict=True)]
    peak = [max(run[rank]["peak_rss_train_mib"] for run in runs) for rank in range(world)]
    increase = [max(run[rank]["peak_rss_increase_mib"] for run in runs) for rank in range(world)]
    return {
        "description": DESCRIPTIONS[name],
        "num_params": r0["num_params"],
        "param_bytes": r0["param_bytes"],
        "local_param_numel_per_rank": [r["local_param_numel"] for r in last],
        "reduce_bytes_per_step": reduce_bytes,
        "reduce_bytes_per_step_per_param_byte": reduce_bytes / r0["param_bytes"],
        "reduce_bytes_how": how,
        "all_gather_bytes_per_step": gather_bytes,
        "comm_bytes_per_step_rank0": [run[0]["comm_bytes_per_step"] for run in runs],
        "reduce_scatter_fallback": r0["reduce_scatter_fallback"],
        "median_step_s": statistics.median(steps[0]),
        "median_step_s_per_repeat": [statistics.median(run[0]["step_times_s"]) for run in runs],
        "median_slowest_rank_step_s": statistics.median(slowest),
        "median_cpu_s_per_step_per_rank": [statistics.median(c) for c in cpu],
        "step_times_s_per_rank": [[round(t, 4) for t in ts] for ts in steps],
        "cpu_times_s_per_rank": [[round(t, 3) for t in c] for c in cpu],
        "median_micro_batch_s": statistics.median(steps[0]) / m,
        "peak_rss_train_mib_per_rank": peak,
        "peak_rss_increase_mib_per_rank": increase,
        "peak_rss_train_mib_per_repeat_per_rank": [[r["peak_rss_train_mib"] for r in run] for run in runs],
        "rss_after_setup_mib_per_rank": [r["rss_after_setup_mib"] for r in last],
        "rss_after_train_mib_per_rank": [r["rss_after_train_mib"] for r in last],
        "hwm_reset": all(r["hwm_reset"] for run in runs for r in run),
        "setup_s": max(r["setup_s"] for run in runs for r in run),
        "losses": r0["losses"],
        "losses_identical_across_repeats": all(run[0]["losses"] == r0["losses"] for run in runs),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ratios(results: dict[str, dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    a, b = results.get(num), results.get(den)
    if not a or not b or "error" in a or "error" in b:
        return None
    return {
        "reduce_bytes": _ratio(a["reduce_bytes_per_step"], b["reduce_bytes_per_step"]),
        "peak_rss": _ratio(max(a["peak_rss_train_mib_per_rank"]), max(b["peak_rss_train_mib_per_rank"])),
        "peak_rss_increase": _ratio(
            max(a["peak_rss_increase_mib_per_rank"]), max(b["peak_rss_increase_mib_per_rank"])
        ),
        "median_step_time": _ratio(a["median_step_s"], b["median_step_s"]),
        "median_cpu_time": _ratio(
            max(a["median_cpu_s_per_step_per_rank"]), max(b["median_cpu_s_per_step_per_rank"])
        ),
    }


def format_table(results: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> str:
    head = [
        "contender",
        "reduce MiB/step",
        "x param bytes",
        "all-gather MiB/step",
        "median step s",
        "slowest-rank s",
        "CPU s/step/rank",
        "peak RSS MiB/rank",
        "train ΔRSS MiB/rank",
        "losses (global mean per step)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | FAILED: {r['error'].strip().splitlines()[-1][:100]} |")
            continue
        ddp = name == "ddp"
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    f"{r['reduce_bytes_per_step'] / MIB:.1f}" + (" (computed)" if ddp else ""),
                    f"{r['reduce_bytes_per_step_per_param_byte']:.2f}",
                    "-" if ddp else f"{r['all_gather_bytes_per_step'] / MIB:.1f}",
                    f"{r['median_step_s']:.3f}",
                    f"{r['median_slowest_rank_step_s']:.3f}",
                    " / ".join(f"{x:.2f}" for x in r["median_cpu_s_per_step_per_rank"]),
                    " / ".join(f"{x:.0f}" for x in r["peak_rss_train_mib_per_rank"]),
                    " / ".join(f"{x:.0f}" for x in r["peak_rss_increase_mib_per_rank"]),
                    ", ".join(f"{x:.5f}" for x in r["losses"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset",
        choices=[k for k in PRESETS if PRESETS[k]["device"] == "cpu"],
        default="cpu-small",
        help="model size from step_time.py (its batch size is replaced by --micro-batch-size)",
    )
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="run every contender this many times, interleaved")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list, run in this order")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a contender may run")
    p.add_argument("--out", type=Path, default=None, help="default docs/bench/accumulation_<preset>.json")
    args = p.parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if any(c not in CONTENDERS for c in contenders):
        raise SystemExit(f"--contenders: choose from {', '.join(CONTENDERS)}")
    if min(args.micro_batches, args.steps, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit("--micro-batches, --steps and --repeats must be >= 1, --warmup >= 0")
    cfg = dict(PRESETS[args.preset])
    cfg.update(
        preset=args.preset,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        world_size=args.world_size,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        optimizer="AdamW(lr=1e-4), other defaults",
        loss="cross-entropy / micro_batches per micro-batch",
        timed_region="all micro-batches (forward + loss + backward) + optimizer.step() + zero_grad(set_to_none=True)",
    )
    del cfg["batch_size"]  # the preset's: not used (micro_batch_size is)
    from flatshard.testing import spawn

    started = utc_now()
    machine = machine_info(cfg)
    print(
        f"{args.preset}: d_model={cfg['d_model']} n_layer={cfg['n_layer']} vocab={cfg['vocab_size']} "
        f"seq={cfg['seq_len']} | {args.world_size} ranks x {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} per optimizer step | warmup {args.warmup}, timed {args.steps}, "
        f"repeats {args.repeats}",
        flush=True,
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in contenders}
    loads: dict[str, list[float]] = {c: [] for c in contenders}
    errors: dict[str, str] = {}
    for rep in range(args.repeats):
        for name in contenders:  # interleaved, so slow drifts of the machine hit every contender alike
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                per_rank = spawn(run, args.world_size, cfg, name, timeout=args.timeout)
            except Exception as err:  # record and go on with the others
                errors[name] = f"{type(err).__name__}: {err}"
                print(f"  {name}: FAILED\n{err}", flush=True)
                continue
            runs[name].append(per_rank)
            loads[name].append(round(os.getloadavg()[0], 2))
            r0 = per_rank[0]
            print(
                f"  [{rep + 1}/{args.repeats}] {name}: {time.perf_counter() - t0:.0f}s, median step "
                f"{statistics.median(r0['step_times_s']):.3f}s (CPU {statistics.median(r0['cpu_times_s']):.2f}s), "
                f"peak RSS {[r['peak_rss_train_mib'] for r in per_rank]} MiB, load {loads[name][-1]}",
                flush=True,
            )
    results: dict[str, dict[str, Any]] = {}
    for name in contenders:
        if name in errors:
            results[name] = {"description": DESCRIPTIONS[name], "error": errors[name]}
            continue
        results[name] = summarize(name, runs[name], cfg)
        results[name]["loadavg_1min_after_each_run"] = loads[name]
    ok = [r for r in results.values() if "error" not in r]
    summary: dict[str, Any] = {
        "no_sync/sharded": ratios(results, "no_sync", "sharded"),
        "no_sync/ddp": ratios(results, "no_sync", "ddp"),
        "sharded/ddp": ratios(results, "sharded", "ddp"),
    }
    if len(ok) > 1:
        summary["max_loss_diff_between_contenders"] = max(
            max(r["losses"][i] for r in ok) - min(r["losses"][i] for r in ok)
            for i in range(len(ok[0]["losses"]))
        )
    table = format_table(results, cfg)
    print()
    print(table)
    print()
    for key in ("no_sync/sharded", "no_sync/ddp", "sharded/ddp"):
        rat = summary[key]
        if rat:
            print(
                f"{key}: reduce bytes x{rat['reduce_bytes']:.3f}, peak RSS x{rat['peak_rss']:.3f} "
                f"(training ΔRSS x{rat['peak_rss_increase']:.3f}), median step time x{rat['median_step_time']:.3f} "
                f"(CPU time x{rat['median_cpu_time']:.3f})"
            )
    if "max_loss_diff_between_contenders" in summary:
        print(f"max loss difference between contenders: {summary['max_loss_diff_between_contenders']:.2e}")
    machine["loadavg_at_end"] = list(os.getloadavg())
    out = args.out or default_out(f"accumulation_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "accumulation",
        "date": started,
        "command": "python benchmarks/accumulation.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "config": cfg,
        "bytes_definition": (
            "bytes this rank passed into gradient-reduction collectives per optimizer step (collective "
            "input size, as flatshard's comm_stats counts them: a reduce-scatter counts the full unsharded "
            "flat gradient, an all-reduce the tensor), not bytes on the wire"
        ),
        "results": results,
        "summary": summary,
        "table": table,
    }
    write_json(out, report)
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
