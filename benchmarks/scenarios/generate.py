"""Greedy generation from a sharded model: tokens/s and memory of the ways to call ``generate``, side by side.

``unsharded``: the plain model on one rank, the reference. ``flatshard`` (``flatshard.shard(model,
auto_wrap_policy={Block})``) with each ``--modes`` a row: ``unshard_params`` (every rank generates inside
``unshard_params(model, writeback=False)``), ``rank0_only`` (the same with ``rank0_only=True``: rank 0 generates),
``registered`` (``register_forward_method(model, "generate")``: units gathered once per call), ``regather``
(``keep_gathered=False``: gathered for every token), ``plain`` (no registration: the root's hooks gather every
token). A generation's time is its slowest generating rank's; peak RSS is ``VmHWM`` over the timed generations,
shard RSS the RSS after sharding (both after ``malloc_trim(0)``: a labelled condition). Tokens must equal the
reference's before anything is compared.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import contenders as reg
from ..measure import cpu_s, hwm_mib, malloc_trim, median, reset_peak_rss, rss_mib
from ..model import build_model
from ..report import Column, Panel
from ..schema import Row
from . import add_gpt_arguments, check_against, failed, gpt_config, interleaved

PRESETS = ("cpu-small", "tiny")
CONTENDERS = ("unsharded", "flatshard")
DEFAULT_CONTENDERS = CONTENDERS
MODES = ("unshard_params", "rank0_only", "registered", "regather", "plain")
REFERENCE = "unsharded"
RATIOS = ("tokens_per_s", "cpu_s_per_gen")
COLUMNS = [
    Column("ranks", "ranks", "d"),
    Column("tokens/s", "tokens_per_s", ".1f"),
    Column("x unsharded", "/tokens_per_s", ".2f"),
    Column("CPU s/gen/rank", "cpu_s_per_gen", ".2f"),
    Column("all-gather MiB/gen/rank", "all_gather_mib", ".1f"),
    Column("shard RSS MiB/rank", "shard_rss_mib", ".0f"),
    Column("peak RSS MiB/rank", "peak_rss_mib", ".0f"),
    Column("training step peak MiB/rank", "train_peak_rss_mib", ".0f"),
]
PANELS = [Panel("tokens/s", ("tokens_per_s",)), Panel("MiB per rank", ("shard_rss_mib", "peak_rss_mib"))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_gpt_arguments(p, steps=3, warmup=1)  # --steps: timed generations, --warmup: untimed ones
    p.add_argument("--modes", default=",".join(MODES), help=f"flatshard's rows, of {', '.join(MODES)}")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    cfg = gpt_config(args)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes) or args.prompt_len > cfg["seq_len"]:
        raise SystemExit(
            f"--modes: of {', '.join(MODES)}; --prompt-len: at most the context ({cfg['seq_len']})"
        )
    cfg.update(
        device="cpu", modes=modes, new_tokens=args.new_tokens, prompt_len=args.prompt_len, batch_size=1
    )
    return cfg, ""


def generate_rank(rank: int, world: int, mode: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import flatshard
    from flatshard.engine.transport import comm

    reg.rank_device(cfg, rank)
    g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 7)
    prompt = torch.randint(0, cfg["vocab_size"], (1, cfg["prompt_len"]), generator=g)
    tiny = build_model(dict(cfg, d_model=64, n_layer=1, n_head=1)).eval()  # the kernels' code pages, first
    tiny.generate(prompt, 2)
    del tiny
    model = build_model(cfg).eval()
    info: dict[str, Any] = {"generates": mode != "rank0_only" or rank == 0}
    if mode != "unsharded":
        flatshard.shard(model, auto_wrap_policy={reg.Block})
        if mode in ("registered", "regather"):
            flatshard.register_forward_method(model, "generate", keep_gathered=mode == "registered")
        # what a training step costs the ranks (rank0_only's other ranks should stay below it); lr 0 keeps weights
        gc.collect()
        malloc_trim()
        reset_peak_rss()
        model.train()
        model(prompt).float().mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        model.zero_grad(set_to_none=True)
        model.eval()
        info["train_peak_rss_mib"] = hwm_mib()

    def once() -> torch.Tensor | None:
        if mode in ("unshard_params", "rank0_only"):
            with (
                flatshard.unshard_params(model, rank0_only=mode == "rank0_only", writeback=False),
                torch.no_grad(),
            ):
                return model.generate(prompt, cfg["new_tokens"]) if info["generates"] else None
        with torch.no_grad():
            return model.generate(prompt, cfg["new_tokens"])

    gc.collect()
    dist.barrier()
    malloc_trim()
    info["shard_rss_mib"] = rss_mib()
    for _ in range(cfg["warmup"]):
        once()
    gc.collect()
    dist.barrier()
    malloc_trim()
    info["hwm_reset"] = reset_peak_rss()
    times, cpus, gathered, tokens = [], [], [], []
    for _ in range(cfg["steps"]):
        dist.barrier()
        comm.comm_stats.clear()
        c0 = cpu_s()
        start = time.perf_counter()
        out = once()
        times.append(time.perf_counter() - start)
        cpus.append(cpu_s() - c0)
        gathered.append(comm.comm_stats["all_gather"] / 2**20)
        tokens.append(None if out is None else out[:, cfg["prompt_len"] :].tolist())
    info.update(times=times, cpus=cpus, gathered=gathered, tokens=tokens, peak_rss_mib=hwm_mib())
    return info


def _row(mode: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> Row:
    last = runs[-1]
    slowest = [max(ts) for run in runs for ts in zip(*(r["times"] for r in run if r["generates"]))]
    tokens = [t for run in runs for r in run if r["generates"] for t in r["tokens"]]
    name = "unsharded" if mode == "unsharded" else f"flatshard {mode}"
    metrics: dict[str, Any] = {
        "ranks": len(last),
        "tokens_per_s": cfg["new_tokens"] / (median(slowest) or float("nan")),
        "cpu_s_per_gen": [median(r["cpus"]) for r in last],
        "all_gather_mib": [median(r["gathered"]) for r in last],
        "shard_rss_mib": [round(r["shard_rss_mib"], 1) for r in last],
        "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in last],
        "train_peak_rss_mib": [round(r["train_peak_rss_mib"], 1) for r in last]
        if mode != "unsharded"
        else None,
        "tokens": tokens[-1],
        "tokens_all_equal": all(t == tokens[-1] for t in tokens),
    }
    label = "" if mode == "unsharded" else mode
    return Row(name=name, contender=name.split()[0], label=label, metrics=metrics, runs=runs)


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    plan = (["unsharded"] if "unsharded" in contenders else []) + (
        cfg["modes"] if "flatshard" in contenders else []
    )
    world = lambda mode: 1 if mode == "unsharded" else cfg["world_size"]  # noqa: E731
    runs, errors = interleaved(
        plan, cfg["repeats"], lambda m: reg.run_ranks(generate_rank, world(m), m, cfg, cfg=cfg)
    )
    rows = [failed("flatshard", errors[m], m) if m in errors else _row(m, runs[m], cfg) for m in plan]

    def same_tokens(row: Row, ref: Row) -> str | None:
        if row.metrics["tokens_all_equal"] and row.metrics["tokens"] == ref.metrics["tokens"]:
            return None
        return "generated tokens differ from the unsharded model's"

    check_against(rows, next((r for r in rows if r.name == "unsharded" and r.ok), None), same_tokens)
    notes = [
        "unsharded runs one process, the others two: other load hurts the two-rank rows more (see CPU s)"
    ]
    return rows, notes


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    return [(r.name, "unsharded") for r in rows if r.name != "unsharded"]
