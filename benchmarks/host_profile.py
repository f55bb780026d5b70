"""Where a training step's time goes on one rank: the host's issue time against the device's work.

    PYTHONPATH=src python benchmarks/host_profile.py --preset cuda-1b --out /tmp/hp.json
    python benchmarks/host_profile.py --preset cpu-small --d-model 64 --seq-len 16   # rehearsal on a CPU

For each contender (``--contenders``, default ``flatshard,ddp``), on one rank: ``--warmup`` steps, then
``--steps`` timed steps, each timed twice: ``issue_s`` until ``optimizer.step()`` and ``zero_grad()``
return on the host (nothing synchronizes), and ``step_s`` once the device has finished too. On a GPU an
``issue_s`` close to ``step_s`` means the device waited for the host (the step is host-bound); far below it,
the device's work sets the pace. Then ``--profile-steps`` steps under ``torch.profiler``: per step, the
device kernels' total time, count and the part of the step the device was busy (the union of kernel
intervals), and the operators and kernels that took the most time, so two contenders' extra work can be
compared line by line. One JSON (``--out``) and a printed summary.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_contenders import spawn_ranks, wrap_contender
from bench_model import PRESETS, build_model, make_batches
from bench_output import machine_info, utc_now, write_json


def _busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlapping kernels on several streams count once)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _profile(step: Any, batches: list[Any], device: torch.device, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for idx, tgt in batches[:steps]:
            step(idx, tgt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    # Device-side events, less the ranges a record_function annotation also draws on the device
    # ("Optimizer.step#AdamW.step", "DistributedDataParallel.forward"): they span kernels, they are none.
    annotated = {e.name for e in events if getattr(e, "is_user_annotation", False)}
    kernels = [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name not in annotated
    ]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    out: dict[str, Any] = {"profiled_steps": steps, "profiled_wall_s_per_step": wall / steps}
    if kernels:
        out["kernel_s_per_step"] = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps
        out["kernels_per_step"] = len(kernels) / steps
        out["device_busy_s_per_step"] = _busy_union(intervals) / 1e6 / steps
    table = prof.key_averages()
    by_cpu = sorted(table, key=lambda a: a.self_cpu_time_total, reverse=True)[:25]
    out["top_cpu_ops"] = [
        {
            "name": a.key,
            "calls_per_step": a.count / steps,
            "self_cpu_ms_per_step": a.self_cpu_time_total / 1e3 / steps,
        }
        for a in by_cpu
    ]
    if kernels:
        totals: dict[str, list[float]] = {}
        for e in kernels:
            entry = totals.setdefault(e.name, [0.0, 0.0])
            entry[0] += e.time_range.elapsed_us()
            entry[1] += 1
        top = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:25]
        out["top_kernels"] = [
            {"name": name[:120], "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps}
            for name, (us, n) in top
        ]
    return out


def run(rank: int, world_size: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(cfg["threads"])
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    info: dict[str, Any] = {"precision_used": cfg["precision"]}
    model = wrap_contender(name, build_model(cfg), cfg, rank, device, info)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batches = make_batches(cfg, rank, world_size, device)
    mixed = info["precision_used"] == "bf16-mixed"
    vocab = cfg["vocab_size"]

    def step(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with (
            torch.autocast(device_type=device.type, dtype=torch.bfloat16)
            if mixed
            else contextlib.nullcontext()
        ):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    gc.collect()
    issue, total, losses = [], [], []
    for i, (idx, tgt) in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses.append(step(idx, tgt))
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if i >= cfg["warmup"]:
            issue.append(t1 - t0)
            total.append(t2 - t0)
    info["issue_s"] = statistics.median(issue)
    info["step_s"] = statistics.median(total)
    info["issue_over_step"] = info["issue_s"] / info["step_s"]
    info["losses"] = [round(float(v), 6) for v in torch.stack(losses).cpu().tolist()]
    info.update(_profile(step, batches, device, cfg["profile_steps"]))
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cuda-1b")
    for field in ("d_model", "n_layer", "n_head", "batch_size", "seq_len", "vocab_size"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=None, help="overrides the preset")
    p.add_argument("--contenders", default="flatshard,ddp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg: dict[str, Any] = dict(PRESETS[args.preset])
    for field in ("d_model", "n_layer", "n_head", "batch_size", "seq_len", "vocab_size"):
        if getattr(args, field) is not None:
            cfg[field] = getattr(args, field)
    cuda = cfg.get("device") == "cuda" and torch.cuda.is_available()
    cfg.update(
        device="cuda" if cuda else "cpu",
        precision="bf16-mixed",
        reduce_dtype="float32",
        seed=0,
        threads=args.threads,
        warmup=args.warmup,
        steps=args.steps + args.profile_steps,
        profile_steps=args.profile_steps,
        flatshard_forward_prefetch="off",
        flatshard_backward_prefetch="auto",
        lora=0,
    )
    report: dict[str, Any] = {"date": utc_now(), "command": " ".join(sys.argv), "config": cfg, "results": {}}
    for name in args.contenders.split(","):
        print(f"[{name}] ...", flush=True)
        try:
            (res,) = spawn_ranks(run, 1, name, cfg, backend="nccl" if cuda else "gloo", timeout=args.timeout)
        except Exception as exc:  # a peer that fails is reported, the others still run
            report["results"][name] = {"status": "failed", "error": repr(exc)[-800:]}
            print(f"[{name}] failed: {exc!r}"[:400], flush=True)
            continue
        report["results"][name] = {"status": "ok", **res}
        line = f"  step {res['step_s'] * 1e3:.1f} ms, host issue {res['issue_s'] * 1e3:.1f} ms"
        if "kernel_s_per_step" in res:
            line += (
                f", kernels {res['kernel_s_per_step'] * 1e3:.1f} ms ({res['kernels_per_step']:.0f}),"
                f" device busy {res['device_busy_s_per_step'] * 1e3:.1f} ms"
            )
        print(line, flush=True)
    report["machine"] = machine_info(cfg)
    if args.out is not None:
        write_json(args.out, report, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
