"""Greedy generation from a sharded model: tokens/s and memory of the ways to call ``generate``, side by side.

Every contender generates ``--new-tokens`` tokens greedily (``GPT.generate`` of ``examples/gpt/model.py``)
from the same fixed random prompt (``--batch-size`` x ``--prompt-len`` token ids from ``--seed``) with the same
GPT (``--preset``, identical init), each contender in freshly spawned processes with a fresh gloo process
group on CPU:

* ``unsharded``: the plain model, not sharded, on one spawned rank: the reference;
* ``unshard_params``: sharded (``flatshard.shard(model, auto_wrap_policy={Block})``); every rank generates
  inside ``flatshard.unshard_params(model, writeback=False)`` (whole model gathered once, then no collective);
* ``rank0_only``: the same with ``unshard_params(model, rank0_only=True, writeback=False)``; only rank 0
  generates, the other ranks keep their shards;
* ``registered``: ``flatshard.register_forward_method(model, "generate")`` (``keep_gathered=True``): every
  rank calls ``model.generate``; each unit is gathered once and stays gathered until generate returns;
* ``regather``: the same with ``keep_gathered=False``: units are gathered again for every token;
* ``plain``: the sharded model's ``generate`` without registration: every forward of the decode loop goes
  through the root's hooks, so it too gathers every unit for every token.

Per contender: tokens/s (median over ``--repeats`` timed generations after ``--warmup`` untimed ones; the
time of a generation is that of the slowest generating rank and includes entering and leaving
``unshard_params``), each rank's RSS right after sharding ("shard memory") and its peak RSS during the timed
generations (``VmHWM`` reset right before them), the bytes each rank sent into all-gathers per generation
(``flatshard.engine.transport.comm.comm_stats``), and whether the generated tokens equal the reference's.
Ratios: tokens/s of each contender / ``unsharded``; targets: ``registered`` >= 0.8x ``unsharded``'s tokens/s,
and in ``rank0_only`` every other rank's peak <= its shard memory.

    python benchmarks/generate.py                                  # cpu-small, 64 new tokens, ~4 min
    python benchmarks/generate.py --new-tokens 8 --repeats 1       # smoke run

Writes ``docs/bench/generate_<preset>.json`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_contenders import spawn_ranks
from bench_measure import MIB, malloc_trim, median, mib, proc_status_kib, reset_peak_rss, rss_kib
from bench_model import MODEL_FIELDS, PRESETS, Block, build_model
from bench_output import (
    default_out,
    failed_row,
    fmt,
    indent,
    machine_info,
    markdown_table,
    utc_now,
    write_json,
)

CONTENDERS = ("unsharded", "unshard_params", "rank0_only", "registered", "regather", "plain")
DESCRIPTIONS = {
    "unsharded": "plain model, not sharded, one rank: model.generate(...) (the reference)",
    "unshard_params": "sharded; all ranks: with unshard_params(model, writeback=False), no_grad(): model.generate",
    "rank0_only": "sharded; with unshard_params(model, rank0_only=True, writeback=False): rank 0 generates",
    "registered": "sharded; register_forward_method(model, 'generate') (keep_gathered=True); all ranks generate",
    "regather": "sharded; register_forward_method(model, 'generate', keep_gathered=False); all ranks generate",
    "plain": "sharded; model.generate without registration (root forward gathers every token); all ranks",
}
REFERENCE = "unsharded"
TARGET_REGISTERED_RATIO = 0.8


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------------


def rss_split_mib() -> dict[str, float | None]:
    """This process's RSS by kind: anonymous (heap, tensors), file-backed (code), shared memory (the
    transport's ``/dev/shm`` segments, counted in every rank that maps them)."""
    st = proc_status_kib("RssAnon", "RssFile", "RssShmem")
    return {k: mib(v) for k, v in st.items()}


def make_prompt(cfg: dict[str, Any]) -> torch.Tensor:
    """The fixed prompt: ``batch_size`` x ``prompt_len`` random token ids from the seed (same for everyone)."""
    g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 7)
    return torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["prompt_len"]), generator=g)


def _warm_up_kernels(cfg: dict[str, Any]) -> None:
    """A plain-torch greedy generation of 2 tokens with a 1-layer, d_model 64 GPT of the same vocabulary, so
    that the code pages of the kernels a generation runs (file-backed libtorch pages) are in RSS before the
    shard memory is measured, as ``memory.py`` does for training. Nothing of flatshard's is set up here. What
    the kernels keep for the real model's shapes (~10 MiB of anonymous memory on ``cpu-small``) is not
    included: it shows in the peak - shard memory of every rank that generates, the reference's too, and not
    in a rank that only holds its shard (``rank0_only``'s other ranks)."""
    tiny = build_model(dict(cfg, d_model=64, n_layer=1, n_head=1))
    tiny.eval()
    tiny.generate(make_prompt(cfg), 2)
    del tiny


def run_contender(rank: int, world_size: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One contender on one rank of a fresh process group; returns this rank's measurements."""
    torch.set_num_threads(cfg["threads"])
    import flatshard
    from flatshard.engine.transport import comm

    info: dict[str, Any] = {"rank": rank}
    if cfg["warm_up_kernels"]:
        _warm_up_kernels(cfg)
    info["rss_before_build_mib"] = mib(rss_kib())
    model = build_model(cfg)
    model.eval()
    info["num_params"] = sum(p.numel() for p in model.parameters())  # tied weight counted once
    info["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    info["rss_after_build_mib"] = mib(rss_kib())
    if name != "unsharded":
        flatshard.shard(model, auto_wrap_policy={Block}, device=torch.device("cpu"))
        if name == "registered":
            flatshard.register_forward_method(model, "generate")  # keep_gathered=True, the default
        elif name == "regather":
            flatshard.register_forward_method(model, "generate", keep_gathered=False)
    info["local_param_numel"] = sum(p.numel() for p in model.parameters())
    prompt = make_prompt(cfg)
    n_new = cfg["new_tokens"]
    generates = name != "rank0_only" or rank == 0
    info["generates"] = generates

    def generate_once() -> torch.Tensor | None:
        if name in ("unshard_params", "rank0_only"):
            with (
                flatshard.unshard_params(model, rank0_only=name == "rank0_only", writeback=False),
                torch.no_grad(),
            ):
                return model.generate(prompt, n_new) if generates else None
        with torch.no_grad():
            return model.generate(prompt, n_new)

    if name != "unsharded":
        # Training-time memory: one training step (forward, backward, optimizer step; lr=0 keeps the weights, so
        # the tokens still equal the reference's) and its peak RSS, what the other ranks of `rank0_only` hold
        # while training anyway (the shards, a gathered unit at a time, gradient shards).
        gc.collect()
        malloc_trim(cfg["malloc_trim"])
        reset_peak_rss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model.train()
        model(prompt).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        info["train_step_peak_rss_mib"] = mib(proc_status_kib("VmHWM")["VmHWM"])
        del optimizer
    gc.collect()
    dist.barrier()
    info["rss_after_shard_untrimmed_mib"] = mib(rss_kib())
    info["malloc_trim"] = malloc_trim(cfg["malloc_trim"])
    info["shard_rss_mib"] = mib(rss_kib())  # "shard memory" (the full model for `unsharded`)
    info["shard_rss_split_mib"] = rss_split_mib()
    info["hwm_reset_warmup"] = reset_peak_rss()
    tokens: list[list[list[int]]] = []
    warmup_s = []
    for _ in range(cfg["warmup"]):
        dist.barrier()
        t0 = time.perf_counter()
        out = generate_once()
        warmup_s.append(time.perf_counter() - t0)
        if out is not None:
            tokens.append(out[:, cfg["prompt_len"] :].tolist())
    info["warmup_s"] = warmup_s
    info["peak_rss_warmup_mib"] = mib(proc_status_kib("VmHWM")["VmHWM"])
    gc.collect()
    dist.barrier()
    malloc_trim(cfg["malloc_trim"])
    info["rss_before_timed_mib"] = mib(rss_kib())
    info["rss_before_timed_split_mib"] = rss_split_mib()
    info["hwm_reset"] = reset_peak_rss()  # from here on: the timed generations only
    times, cpu_times, comm_per_gen = [], [], []
    for _ in range(cfg["repeats"]):
        dist.barrier()
        comm.comm_stats.clear()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = generate_once()
        elapsed = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        comm_per_gen.append(dict(comm.comm_stats))
        times.append(elapsed)
        cpu_times.append(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
        if out is not None:
            tokens.append(out[:, cfg["prompt_len"] :].tolist())
    st = proc_status_kib("VmHWM", "VmRSS")
    info["peak_rss_timed_mib"] = mib(st["VmHWM"])
    info["rss_after_timed_mib"] = mib(st["VmRSS"])
    info["rss_after_timed_split_mib"] = rss_split_mib()
    info["gen_times_s"] = times
    info["cpu_times_s"] = cpu_times
    info["comm_bytes_per_gen"] = comm_per_gen
    info["tokens"] = tokens[-1] if tokens else None
    info["tokens_same_every_generation"] = all(t == tokens[-1] for t in tokens) if tokens else None
    dist.barrier()
    return info


# ----------------------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------------------


def summarize(name: str, per_rank: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    gen = [r for r in per_rank if r["generates"]]
    # a generation lasts until its slowest generating rank is done
    slowest = [max(ts) for ts in zip(*(r["gen_times_s"] for r in gen))]
    med = median(slowest)
    new = cfg["batch_size"] * cfg["new_tokens"]
    gathers = [[c.get("all_gather", 0) for c in r["comm_bytes_per_gen"]] for r in per_rank]
    tokens = gen[0]["tokens"]
    return {
        "status": "ok",
        "description": DESCRIPTIONS[name],
        "world_size": len(per_rank),
        "generating_ranks": [r["rank"] for r in gen],
        "num_params": per_rank[0]["num_params"],
        "param_bytes": per_rank[0]["param_bytes"],
        "local_param_numel_per_rank": [r["local_param_numel"] for r in per_rank],
        "median_gen_s": med,
        "tokens_per_s": new / med if med else None,
        "gen_times_s_slowest_rank": [round(t, 4) for t in slowest],
        "gen_times_s_per_rank": [[round(t, 4) for t in r["gen_times_s"]] for r in per_rank],
        "median_cpu_s_per_gen_per_rank": [median(r["cpu_times_s"]) for r in per_rank],
        "cpu_times_s_per_rank": [[round(t, 3) for t in r["cpu_times_s"]] for r in per_rank],
        "warmup_s_per_rank": [[round(t, 3) for t in r["warmup_s"]] for r in per_rank],
        "all_gather_bytes_per_gen_per_rank": [median(g) for g in gathers],
        "comm_bytes_per_gen_per_rank": [r["comm_bytes_per_gen"] for r in per_rank],
        "rss_after_build_mib_per_rank": [r["rss_after_build_mib"] for r in per_rank],
        "rss_after_shard_untrimmed_mib_per_rank": [r["rss_after_shard_untrimmed_mib"] for r in per_rank],
        "shard_rss_mib_per_rank": [r["shard_rss_mib"] for r in per_rank],
        "train_step_peak_rss_mib_per_rank": [r.get("train_step_peak_rss_mib") for r in per_rank],
        "peak_rss_warmup_mib_per_rank": [r["peak_rss_warmup_mib"] for r in per_rank],
        "rss_before_timed_mib_per_rank": [r["rss_before_timed_mib"] for r in per_rank],
        "peak_rss_timed_mib_per_rank": [r["peak_rss_timed_mib"] for r in per_rank],
        "peak_minus_shard_mib_per_rank": [
            round(r["peak_rss_timed_mib"] - r["shard_rss_mib"], 1) for r in per_rank
        ],
        "rss_after_timed_mib_per_rank": [r["rss_after_timed_mib"] for r in per_rank],
        "rss_split_mib_per_rank": [
            {
                "after_shard": r["shard_rss_split_mib"],
                "before_timed": r["rss_before_timed_split_mib"],
                "after_timed": r["rss_after_timed_split_mib"],
            }
            for r in per_rank
        ],
        "hwm_reset": all(r["hwm_reset"] for r in per_rank),
        "malloc_trim": all(r["malloc_trim"] for r in per_rank),
        "tokens": tokens,
        "tokens_same_on_every_generating_rank": all(r["tokens"] == tokens for r in gen),
        "tokens_same_every_generation": all(r["tokens_same_every_generation"] for r in gen),
    }


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref, reg, r0 = (results.get(k, {}) for k in (REFERENCE, "registered", "rank0_only"))
    if ref.get("status") == "ok" and reg.get("status") == "ok":
        ratio = reg["tokens_per_s"] / ref["tokens_per_s"]
        out["registered_tokens_per_s_ratio"] = {
            "target": f">= {TARGET_REGISTERED_RATIO}",
            "value": ratio,
            "met": ratio >= TARGET_REGISTERED_RATIO,
        }
    if r0.get("status") == "ok":
        others = [i for i in range(r0["world_size"]) if i not in r0["generating_ranks"]]
        peak = {i: r0["peak_rss_timed_mib_per_rank"][i] for i in others}
        shard = {i: r0["shard_rss_mib_per_rank"][i] for i in others}
        train = {i: r0["train_step_peak_rss_mib_per_rank"][i] for i in others}
        out["rank0_only_other_ranks_peak_le_training_memory"] = {
            "target": "peak RSS of every non-generating rank during the timed generations <= its peak in a training step",
            "peak_mib": peak,
            "train_step_peak_mib": train,
            "met": all(peak[i] <= train[i] for i in others) if others else None,
        }
        out["rank0_only_other_ranks_peak_le_shard_memory"] = {
            "target": "peak RSS of every non-generating rank during the timed generations <= its RSS after sharding",
            "peak_mib": peak,
            "shard_mib": shard,
            "peak_with_warmup_mib": {i: r0["peak_rss_warmup_mib_per_rank"][i] for i in others},
            "rss_before_timed_mib": {i: r0["rss_before_timed_mib_per_rank"][i] for i in others},
            "excess_mib": {i: round(peak[i] - shard[i], 1) for i in others},
            "met": all(peak[i] <= shard[i] for i in others) if others else None,
        }
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    ref = results.get(REFERENCE, {})
    ref_tps = ref.get("tokens_per_s") if ref.get("status") == "ok" else None
    headers = [
        "contender",
        "ranks (gen)",
        "tokens/s",
        f"x {REFERENCE}",
        "median s/gen",
        "CPU s/gen/rank",
        "all-gather MiB/gen/rank",
        "shard RSS MiB/rank",
        "peak RSS MiB/rank",
        "peak-shard MiB/rank",
        "tokens_equal",
    ]
    rows = []
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append(failed_row(name, r, 100))
            continue
        rows.append(
            [
                name,
                f"{r['world_size']} ({','.join(map(str, r['generating_ranks']))})",
                fmt(r["tokens_per_s"], ".1f"),
                fmt(r["tokens_per_s"] / ref_tps if ref_tps else None, ".2f"),
                fmt(r["median_gen_s"], ".3f"),
                " / ".join(fmt(x, ".2f") for x in r["median_cpu_s_per_gen_per_rank"]),
                " / ".join(fmt(b / MIB, ".1f") for b in r["all_gather_bytes_per_gen_per_rank"]),
                " / ".join(fmt(x, ".0f") for x in r["shard_rss_mib_per_rank"]),
                " / ".join(fmt(x, ".0f") for x in r["peak_rss_timed_mib_per_rank"]),
                " / ".join(fmt(x, "+.0f") for x in r["peak_minus_shard_mib_per_rank"]),
                str(r.get("tokens_equal")),
            ]
        )
    return markdown_table(headers, rows)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset", choices=[k for k in PRESETS if PRESETS[k]["device"] == "cpu"], default="cpu-small"
    )
    for field in MODEL_FIELDS:
        if field not in ("batch_size", "seq_len"):  # --batch-size and --block-size below
            p.add_argument(
                f"--{field.replace('_', '-')}", type=int, default=None, help="overrides the preset"
            )
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per generation")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated at once")
    p.add_argument(
        "--block-size", type=int, default=None, help="the model's context (default: the preset's seq_len)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed generations per contender (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations first")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list, run in this order")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the sharded contenders")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-malloc-trim",
        action="store_false",
        dest="malloc_trim",
        help="do not call glibc malloc_trim(0) before measuring the shard memory and before the timed part",
    )
    p.add_argument(
        "--no-kernel-warm-up",
        action="store_false",
        dest="warm_up_kernels",
        help="do not run a tiny plain GPT's generate before building the model (then the shard memory lacks\n"
        "the kernels' code pages, which the first generation adds)",
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ for the ranks (e.g. 65536) so freed tensors go back to the OS\n"
        "and RSS tracks live memory more closely (off by default)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a contender may run")
    p.add_argument("--out", type=Path, default=None, help="default docs/bench/generate_<preset>.json")
    args = p.parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    if min(args.new_tokens, args.prompt_len, args.batch_size, args.repeats, args.world_size) < 1:
        raise SystemExit("--new-tokens, --prompt-len, --batch-size, --repeats, --world-size must be >= 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")
    cfg = dict(PRESETS[args.preset])
    preset_fields = [f for f in MODEL_FIELDS if f not in ("batch_size", "seq_len")]
    overrides = {f: getattr(args, f) for f in preset_fields if getattr(args, f) is not None}
    if args.block_size is not None:
        overrides["seq_len"] = args.block_size
    cfg.update(overrides)
    if args.prompt_len > cfg["seq_len"]:
        raise SystemExit(f"--prompt-len {args.prompt_len} exceeds the model's context {cfg['seq_len']}")
    cfg.update(
        preset=args.preset,
        overrides=overrides,
        batch_size=args.batch_size,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        world_size=args.world_size,
        threads=args.threads,
        seed=args.seed,
        malloc_trim=args.malloc_trim,
        warm_up_kernels=args.warm_up_kernels,
        malloc_mmap_threshold=args.malloc_mmap_threshold,
        block_size_note="seq_len is the GPT's block_size (context); generate crops its input to it",
        timed_region=(
            "model.generate(prompt, new_tokens) under torch.no_grad(); for unshard_params/rank0_only also "
            "entering and leaving the unshard_params context; time of the slowest generating rank"
        ),
    )
    ws = args.world_size
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # inherited by the ranks
    out = args.out or default_out(f"generate_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    machine = machine_info(cfg)
    print(
        f"preset {args.preset}: d_model={cfg['d_model']} n_layer={cfg['n_layer']} n_head={cfg['n_head']} "
        f"vocab={cfg['vocab_size']} context={cfg['seq_len']} | prompt {args.batch_size}x{args.prompt_len}, "
        f"{args.new_tokens} new tokens | {ws} ranks (gloo, CPU), {args.threads} thread(s)/rank | "
        f"warmup {args.warmup}, timed {args.repeats}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    loads: dict[str, list[float]] = {}
    for name in contenders:
        world = 1 if name == REFERENCE else ws
        t0 = time.perf_counter()
        print(f"{name} ({world} rank{'s' if world > 1 else ''}): {DESCRIPTIONS[name]} ...", flush=True)
        try:
            per_rank = spawn_ranks(run_contender, world, name, cfg, backend="gloo", timeout=args.timeout)
            results[name] = summarize(name, per_rank, cfg)
        except Exception as err:  # record it (with the traceback) and go on with the others
            results[name] = {
                "status": "failed",
                "description": DESCRIPTIONS[name],
                "error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}",
            }
            print(
                f"    FAILED after {time.perf_counter() - t0:.1f}s:\n{indent(str(err), '      ')}", flush=True
            )
            continue
        loads[name] = [round(x, 2) for x in os.getloadavg()]
        results[name]["loadavg_after_run"] = loads[name]
        r = results[name]
        print(
            f"    done in {time.perf_counter() - t0:.1f}s (load avg {loads[name][0]:.1f}): "
            f"{fmt(r['tokens_per_s'], '.1f')} tokens/s, median {r['median_gen_s']:.3f}s/generation, "
            f"shard RSS {r['shard_rss_mib_per_rank']} MiB, peak {r['peak_rss_timed_mib_per_rank']} MiB",
            flush=True,
        )

    ref = results.get(REFERENCE, {})
    ref_tokens = ref.get("tokens") if ref.get("status") == "ok" else None
    for r in results.values():
        if r.get("status") == "ok":
            r["tokens_equal"] = (
                None
                if ref_tokens is None
                else (
                    r["tokens"] == ref_tokens
                    and r["tokens_same_on_every_generating_rank"]
                    and r["tokens_same_every_generation"]
                )
            )
    ratios = {
        f"{name}/{REFERENCE}": {
            "tokens_per_s_ratio": r["tokens_per_s"] / ref["tokens_per_s"],
            # CPU seconds of rank 0 per generation: less sensitive than wall time to competing processes
            "rank0_cpu_time_ratio": r["median_cpu_s_per_gen_per_rank"][0]
            / ref["median_cpu_s_per_gen_per_rank"][0],
        }
        for name, r in results.items()
        if r.get("status") == "ok" and ref.get("status") == "ok" and name != REFERENCE
    }
    goals = targets(results)
    notes = []
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        if r["tokens_equal"] is False:
            notes.append(f"{name}: generated tokens differ from {REFERENCE}'s")
        if not r["hwm_reset"]:
            notes.append(f"{name}: could not reset VmHWM; peak RSS is the process-lifetime peak")
        busy = r["loadavg_after_run"][0]
        if busy > ws + 0.75 and (os.cpu_count() or 0) <= 2 * ws:
            notes.append(
                f"{name}: 1-min load average {busy:.1f} after its run (its own ranks account for ~{r['world_size']}): "
                "other processes competed for the CPUs; its times are inflated"
            )
    table = format_table(results)
    print()
    print(table)
    print()
    for key, rat in ratios.items():
        print(
            f"{key}: tokens/s x{rat['tokens_per_s_ratio']:.2f} (rank 0 CPU s per generation "
            f"x{rat['rank0_cpu_time_ratio']:.2f})"
        )
    g = goals.get("registered_tokens_per_s_ratio")
    if g:
        print(
            f"target registered >= {TARGET_REGISTERED_RATIO}x {REFERENCE} tokens/s: "
            f"x{g['value']:.3f} -> {'met' if g['met'] else 'missed'}"
        )
    g = goals.get("rank0_only_other_ranks_peak_le_shard_memory")
    if g:
        detail = ", ".join(
            f"rank {i}: peak {g['peak_mib'][i]} vs shard {g['shard_mib'][i]} MiB ({g['excess_mib'][i]:+.1f}; "
            f"RSS before the timed part {g['rss_before_timed_mib'][i]}, peak of the warm-up "
            f"{g['peak_with_warmup_mib'][i]})"
            for i in g["peak_mib"]
        )
        verdict = {True: "met", False: "missed", None: "n/a (no other rank)"}[g["met"]]
        print(f"rank0_only other ranks' peak <= shard memory (strict): {detail} -> {verdict}")
    g = goals.get("rank0_only_other_ranks_peak_le_training_memory")
    if g:
        detail = ", ".join(
            f"rank {i}: peak {g['peak_mib'][i]} vs training step {g['train_step_peak_mib'][i]} MiB"
            for i in g["peak_mib"]
        )
        verdict = {True: "met", False: "missed", None: "n/a (no other rank)"}[g["met"]]
        print(f"target rank0_only other ranks' peak <= training-time memory: {detail} -> {verdict}")
    for n in notes:
        print("note:", n)
    machine["loadavg_at_end"] = list(os.getloadavg())
    report = {
        "benchmark": "generate",
        "date": started,
        "command": "python benchmarks/generate.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "config": cfg,
        "contenders": contenders,
        "prompt": make_prompt(cfg).tolist(),
        "definitions": {
            "tokens_per_s": "batch_size x new_tokens / median time of a generation (slowest generating rank)",
            "shard_rss": "VmRSS right after sharding (the full model for unsharded), after gc and malloc_trim(0)",
            "peak_rss_timed": "VmHWM over the timed generations, reset (clear_refs) right before them",
            "all_gather_bytes": "bytes this rank passed into all-gathers per generation (comm_stats['all_gather'])",
        },
        "results": results,
        "ratios": ratios,
        "targets": goals,
        "notes": notes,
        "table": table,
    }
    write_json(out, report, default=str)
    print(f"\nwrote {out}")
    ok = [r for r in results.values() if r.get("status") == "ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
