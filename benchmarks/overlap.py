"""How much of flatshard's communication hides behind compute: a timeline of every collective of a step.

**CPU** (the default): ``--world-size`` gloo ranks on this host, so flatshard's all-gathers and
reduce-scatters run on its shared-memory transport, whose worker thread moves the data while the
training thread computes. Inside :func:`flatshard.engine.transport.comm.timeline` each collective records when it
was issued, when the worker ran it and when the training thread blocked in ``wait()`` for it
(*blocked*). Per step and collective kind this reports

* **transport**: time the collectives spent on the transport's worker, from the moment it started one
  until it finished (copying, adding, and waiting for the peers to reach the same collective);
* **blocked**: time the training thread waited for them (communication that was *not* hidden, including
  waiting for a slower peer);
* **overlapped**: transport time during which the training thread was not blocked, i.e. computing or
  issuing more work, and its share of transport time.

It does so for four prefetch settings (no prefetch, ``backward_prefetch=BACKWARD_POST``, ``BACKWARD_PRE``
(the default), and BACKWARD_PRE with ``forward_prefetch=True``) and prints the first timed step of rank 0 as a timeline.

**CUDA** (``--device cuda``, needs 2+ GPUs: NCCL cannot place two ranks on one GPU): ``torch.profiler``
traces the timed steps on rank 0 and the summary compares NCCL kernels (all-gather, reduce-scatter)
with compute kernels on the other streams: the share of each communication kernel's time during which a
compute kernel ran. ``--trace PATH`` also writes the Chrome trace.

    python benchmarks/overlap.py                      # CPU, 2 ranks, the cpu-small GPT, ~2 min
    python benchmarks/overlap.py --device cuda --preset cuda-1b --trace /tmp/overlap_trace.json

Writes ``docs/bench/overlap_<device>.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_measure import median
from bench_model import PRESETS, Block, build_model, make_batches
from bench_output import default_out, machine_info, write_json

SETTINGS = {
    # name: (backward_prefetch, forward_prefetch)
    "no prefetch": (None, False),
    "BACKWARD_POST": ("BACKWARD_POST", False),
    "BACKWARD_PRE (default)": ("BACKWARD_PRE", False),
    "BACKWARD_PRE + forward_prefetch": ("BACKWARD_PRE", True),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(span: tuple[float, float], union: list[tuple[float, float]]) -> float:
    """Length of ``span`` inside the (sorted, disjoint) ``union``."""
    a, b = span
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if y > a and x < b)


def summarize_cpu_step(records: list[Any], t0: int, t1: int) -> dict[str, Any]:
    """Transport / blocked / overlapped milliseconds per kind for one step's CollectiveTimings."""
    blocked_all = _union([w for r in records for w in r.waited])
    out: dict[str, Any] = {"step_ms": (t1 - t0) / 1e6}
    for kind in KINDS:
        mine = [r for r in records if r.kind == kind]
        if not mine:
            continue
        busy = sum(r.busy[1] - r.busy[0] for r in mine if r.busy)
        hidden = sum(r.busy[1] - r.busy[0] - _covered(r.busy, blocked_all) for r in mine if r.busy)
        blocked = sum(b - a for r in mine for a, b in r.waited)
        out[kind] = {
            "count": len(mine),
            "mib": sum(r.nbytes for r in mine) / 2**20,
            "transport_ms": busy / 1e6,
            "blocked_ms": blocked / 1e6,
            "overlapped_ms": hidden / 1e6,
        }
    return out


def _timeline_rows(records: list[Any], t0: int) -> list[dict[str, Any]]:
    def ms(ns: int) -> float:
        return round((ns - t0) / 1e6, 2)

    return [
        {
            "kind": r.kind,
            "mib": round(r.nbytes / 2**20, 2),
            "issued_ms": ms(r.issued_ns),
            "transport_ms": [ms(r.busy[0]), ms(r.busy[1])] if r.busy else None,
            "blocked_ms": [[ms(a), ms(b)] for a, b in r.waited],
        }
        for r in records
    ]


def run_cpu(rank: int, world: int, cfg: dict[str, Any], setting: str) -> dict[str, Any]:
    torch.set_num_threads(cfg["threads"])
    import flatshard
    from flatshard.engine.transport import comm

    backward_prefetch, forward_prefetch = SETTINGS[setting]
    model = flatshard.shard(
        build_model(cfg),
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy={Block},
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(cfg, rank, world, torch.device("cpu"))
    vocab = cfg["vocab_size"]
    steps: list[dict[str, Any]] = []
    first_timeline: list[dict[str, Any]] = []
    for i, (idx, tgt) in enumerate(batches):
        dist.barrier()
        timing = comm.timeline() if i >= cfg["warmup"] else contextlib.nullcontext([])
        with timing as records:
            t0 = time.perf_counter_ns()
            F.cross_entropy(model(idx).view(-1, vocab), tgt.view(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter_ns()
        if i >= cfg["warmup"]:
            steps.append(summarize_cpu_step(records, t0, t1))
            if not first_timeline:
                first_timeline = _timeline_rows(records, t0)
    return {"steps": steps, "timeline": first_timeline if rank == 0 else []}


def aggregate(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed steps, per rank, then the rank that blocked longest."""
    ranks = []
    for r in per_rank:
        steps = r["steps"]
        row: dict[str, Any] = {"step_ms": median([s["step_ms"] for s in steps])}
        for kind in KINDS:
            got = [s[kind] for s in steps if kind in s]
            if got:
                row[kind] = {
                    k: median([g[k] for g in got])
                    for k in ("count", "mib", "transport_ms", "blocked_ms", "overlapped_ms")
                }
                busy = row[kind]["transport_ms"]
                row[kind]["overlapped_share"] = row[kind]["overlapped_ms"] / busy if busy else None
        ranks.append(row)
    return {"per_rank": ranks}


def format_cpu(results: dict[str, Any]) -> str:
    head = "| setting | rank | step ms | collective | count | MiB sent | transport ms | blocked ms | overlapped ms | overlapped |"
    lines = [head, "|" + "---|" * 10]
    for setting, res in results.items():
        for rank, row in enumerate(res["per_rank"]):
            for kind in KINDS:
                if kind not in row:
                    continue
                k = row[kind]
                share = f"{100 * k['overlapped_share']:.0f}%" if k["overlapped_share"] is not None else "-"
                lines.append(
                    f"| {setting} | {rank} | {row['step_ms']:.0f} | {kind} | {k['count']:.0f} | {k['mib']:.0f} | "
                    f"{k['transport_ms']:.1f} | {k['blocked_ms']:.1f} | {k['overlapped_ms']:.1f} | {share} |"
                )
    return "\n".join(lines)


def format_timeline(rows: list[dict[str, Any]], limit: int) -> str:
    lines = ["  issued   on the transport's worker   blocked (training thread)   collective"]
    for r in rows[:limit]:
        busy = f"{r['transport_ms'][0]:8.1f} - {r['transport_ms'][1]:8.1f}" if r["transport_ms"] else " " * 19
        blocked = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in r["blocked_ms"]) or "never"
        lines.append(f"{r['issued_ms']:8.1f}   {busy}       {blocked:<26}  {r['kind']} {r['mib']:.1f} MiB")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CUDA


def run_cuda(rank: int, world: int, cfg: dict[str, Any], trace: str | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    import flatshard

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = flatshard.shard(
        build_model(cfg).to(device), auto_wrap_policy={Block}, mixed_precision=mp, device=device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(cfg, rank, world, device)
    vocab = cfg["vocab_size"]

    def step(idx: torch.Tensor, tgt: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(idx).float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for idx, tgt in batches[: cfg["warmup"]]:
        step(idx, tgt)
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[rank])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for idx, tgt in batches[cfg["warmup"] :]:
            step(idx, tgt)
        torch.cuda.synchronize(device)
    if rank != 0:
        return {}
    path = trace or os.path.join("/tmp", f"flatshard_overlap_{os.getpid()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        data = json.load(f)
    if trace is None:
        os.remove(path)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return summarize_kernels(events, cfg["steps"])


def summarize_kernels(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per NCCL collective kind: kernel time, and the share of it during which a compute kernel ran."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    compute = _union(
        [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e.get("name", "").lower()]
    )
    out: dict[str, Any] = {"steps": steps, "compute_kernel_ms": sum(b - a for a, b in compute) / 1e3 / steps}
    for kind, key in (
        ("all_gather", "allgather"),
        ("reduce_scatter", "reducescatter"),
        ("all_reduce", "allreduce"),
    ):
        mine = [
            e for e in kernels if "nccl" in e["name"].lower() and key in e["name"].lower().replace("_", "")
        ]
        if not mine:
            continue
        total = sum(e["dur"] for e in mine)
        hidden = sum(_covered((e["ts"], e["ts"] + e["dur"]), compute) for e in mine)
        out[kind] = {
            "kernels_per_step": len(mine) / steps,
            "kernel_ms_per_step": total / 1e3 / steps,
            "overlapped_ms_per_step": hidden / 1e3 / steps,
            "overlapped_share": hidden / total if total else None,
            "streams": sorted({e.get("args", {}).get("stream") for e in mine}, key=str),
        }
    return out


# ------------------------------------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: cpu-small / cuda-1b")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, default=None, help="default: 2 on CPU, every GPU on CUDA")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (CPU)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: " + ", ".join(SETTINGS))
    p.add_argument("--timeline-rows", type=int, default=14, help="rows of rank 0's first step to print")
    p.add_argument("--trace", default=None, help="CUDA: also write the Chrome trace here")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="default docs/bench/overlap_<device>.json")
    args = p.parse_args(argv)

    from flatshard.testing import spawn

    preset = args.preset or ("cuda-1b" if args.device == "cuda" else "cpu-small")
    cfg = dict(PRESETS[preset], preset=preset, steps=args.steps, warmup=args.warmup, seed=0)
    cfg["threads"] = args.threads
    cfg["device"] = args.device
    out_path = args.out or default_out(f"overlap_{args.device}.json")
    started = time.time()
    report: dict[str, Any] = {
        "benchmark": "overlap",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(cfg),
        "config": cfg,
    }
    if args.device == "cuda":
        world = args.world_size or torch.cuda.device_count()
        if world < 2:
            raise SystemExit(
                f"--device cuda needs 2 or more GPUs (found {torch.cuda.device_count()}): NCCL cannot run two "
                "ranks on one GPU, and one rank has nothing to communicate."
            )
        summary = spawn(run_cuda, world, cfg, args.trace, backend="nccl", timeout=args.timeout)[0]
        report.update(world_size=world, kernels=summary)
        print(json.dumps(summary, indent=2))
    else:
        world = args.world_size or 2
        settings = [s.strip() for s in args.settings.split(",") if s.strip()]
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown:
            raise SystemExit(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
        results: dict[str, Any] = {}
        for setting in settings:
            print(f"[{setting}] {world} ranks ...", flush=True)
            per_rank = spawn(run_cpu, world, cfg, setting, backend="gloo", timeout=args.timeout)
            results[setting] = aggregate(per_rank)
            results[setting]["timeline_rank0_first_step"] = per_rank[0]["timeline"]
            print(format_timeline(per_rank[0]["timeline"], args.timeline_rows), flush=True)
        table = format_cpu(results)
        print("\nmedian over the timed steps, per rank:\n" + table)
        report.update(world_size=world, results=results, table=table)
    report["total_seconds"] = round(time.time() - started, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, report, indent=1)
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
