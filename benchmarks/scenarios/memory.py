"""Peak memory per rank against model size and world size, beside the theoretical sharded footprint.

For each GPT size, world size and contender, fresh gloo ranks train ``--steps`` steps (``train``'s ranks).
**measured** = peak RSS during training minus the RSS before the model is built (after the imports, the process
group, an AdamW step and a tiny GPT's step: what any training process pays). **theory** = 16 bytes x flatshard's
padded shard on the rank (fp32 parameters, gradients, AdamW's two states) + 8 bytes x its largest unit when N > 1
(gathered parameters and unsharded gradient) + the bytes autograd saves in one forward and loss (flatshard at
N = 1). **shared once**: measured less the shared-memory pages RSS counts in every rank mapping them. Every point
runs with glibc's defaults (the headline) and, as labelled extra rows, with ``MALLOC_MMAP_THRESHOLD_=65536``
(blocks from 64 KiB are unmapped when freed, so RSS follows live memory).
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import contenders as reg
from ..report import Column, Panel
from ..schema import Row
from . import failed, interleaved
from .train import train_rank

PRESETS = ("cpu",)
CONTENDERS = ("flatshard", "fsdp1", "fsdp2", "ddp")
DEFAULT_CONTENDERS = CONTENDERS
ALLOCATORS = {"glibc": None, "mmap64k": 65536}
RATIOS = ("measured_mib",)
COLUMNS = [
    Column("parameters M", "params_m", ".1f"),
    Column("measured MiB/rank", "measured_mib", ".0f"),
    Column("theory MiB", "theory_mib", ".1f"),
    Column("measured ÷ theory", "ratio", ".2f"),
    Column("shared once ÷ theory", "ratio_shared_once", ".2f"),
    Column("after setup MiB/rank", "setup_mib", ".0f"),
]
PANELS = [
    Panel(
        f"{a}: peak MiB per rank (max rank) and theory",
        ("measured_mib", "theory_mib"),
        x="params_m",
        select=a,
    )
    for a in ALLOCATORS
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="256x4,384x6,512x8", help="D_MODELxLAYERS list (heads: d_model / 64)")
    p.add_argument("--world-sizes", default="1,2,4", help="must include 1 (its run counts the activations)")
    p.add_argument("--allocators", default="glibc,mmap64k", help=f"of {', '.join(ALLOCATORS)}")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes.split(",") if s]
    worlds = sorted({int(w) for w in args.world_sizes.split(",")})
    allocators = [a for a in args.allocators.split(",") if a]
    if worlds[0] != 1 or worlds[-1] > 4 or any(a not in ALLOCATORS for a in allocators):
        raise SystemExit(f"--world-sizes: 1 and up to 4; --allocators: of {', '.join(ALLOCATORS)}")
    cfg = dict(vocab_size=args.vocab_size, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps)
    cfg.update(threads=args.threads, seed=args.seed, sizes=sizes, world_sizes=worlds, allocators=allocators)
    cfg.update(device="cpu", warmup=0, precision="fp32", micro_batches=1, optimizer="adamw", lora=0)
    cfg.update(
        poll_memory=False, timeline=False, baseline_before_build=True, unit_sizes=True, shard_group_size=2
    )
    return cfg, ""


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    if "flatshard" not in contenders:
        raise SystemExit("--contenders: the theory comes from flatshard's units. HINT: list flatshard first")
    contenders = ["flatshard", *(c for c in contenders if c != "flatshard")]
    rows: list[Row] = []
    for allocator in cfg["allocators"]:
        for d_model, n_layer in cfg["sizes"]:
            size = f"{d_model}x{n_layer}"
            activations: float | None = None
            for world in cfg["world_sizes"]:
                point = dict(
                    cfg, d_model=d_model, n_layer=n_layer, n_head=max(1, d_model // 64), world_size=world
                )
                point["malloc_mmap_threshold"] = ALLOCATORS[allocator]
                label = f"{size} N={world}" + (
                    "" if allocator == "glibc" else f" {allocator}"
                )  # the row's name
                theory: dict[str, float] | None = None
                for name in contenders:
                    opts = dict(point, count_activations=world == 1 and name == "flatshard")
                    runs, errors = interleaved(
                        [name],
                        cfg["repeats"],
                        lambda c, o=opts: reg.run_ranks(train_rank, o["world_size"], c, o, cfg=o),
                    )
                    if name in errors:
                        rows.append(failed(name, errors[name], label))
                        continue
                    last = runs[name][-1]
                    if name == "flatshard":
                        activations = last[0].get("saved_activations_mib", activations)
                        theory = _theory(last[0], world, activations or 0.0)
                    rows.append(_row(name, label, allocator, world, runs[name], theory))
    notes = ["theory: flatshard's units for every contender (DDP against it shows what sharding saves)"]
    return rows, notes


def _theory(r0: dict[str, Any], world: int, activations_mib: float) -> dict[str, float]:
    unit = 8 * r0["largest_unit_numel"] / 2**20 if world > 1 else 0.0  # at N = 1 the shard is the unit
    state = 16 * r0["shard_numel"] / 2**20
    return {"state_mib": state, "largest_unit_mib": unit, "activations_mib": activations_mib}


def _row(name: str, label: str, allocator: str, world: int, runs: list[Any], theory: dict | None) -> Row:
    """The largest measured value over repeats, per rank."""
    measured = [max(run[k]["peak_rss_mib"] - run[k]["base_rss_mib"] for run in runs) for k in range(world)]
    twice = [runs[-1][k]["shared_pages_twice_mib"] for k in range(world)]
    metrics: dict[str, Any] = {
        "params_m": runs[-1][0]["num_params"] / 1e6,
        "world": world,
        "measured_mib": [round(m, 1) for m in measured],
        "setup_mib": [round(r["rss_after_setup_mib"] - r["base_rss_mib"], 1) for r in runs[-1]],
        "series": f"{name} N={world}",
    }
    if theory is not None:
        total = sum(theory.values())
        metrics.update(theory_mib=total, theory_parts_mib=theory, ratio=max(measured) / total)
        metrics["ratio_shared_once"] = max(m - t for m, t in zip(measured, twice)) / total
    if name != "flatshard":
        metrics.pop("theory_mib", None)  # drawn once, with flatshard's line
    label = label if label.endswith(allocator) else f"{label} {allocator}"
    return Row(
        name=f"{name} {label.removesuffix(' glibc')}", contender=name, label=label, metrics=metrics, runs=runs
    )


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    """flatshard over each peer at the same size, world size and allocator."""
    return [(f"flatshard {r.name.split(' ', 1)[1]}", r.name) for r in rows if r.contender != "flatshard"]
