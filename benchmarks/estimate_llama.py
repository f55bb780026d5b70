"""``flatshard estimate`` for Llama 3 shapes (1B, 8B, 70B) at 8 to 512 GPUs, beside FSDP2's and ZeRO-3's formulas.

Runs the estimator (no GPU, no weights: the models are built on the meta device from their published
dimensions, ``flatshard.testing.llama``) with the settings of a typical run: FULL_SHARD, one unit per block,
bf16 compute and reduction, AdamW, activation checkpointing per block, one 4,096-token sequence per GPU,
InfiniBand (400 Gb/s per GPU) between ranks. Writes, under ``docs/bench/estimate/``:

- ``llama.json``: every estimate (the estimator's JSON rows) and the formula values;
- ``tables.txt``: the Markdown tables ``docs/estimate.md`` includes;
- ``memory.png`` and ``communication.png``: per-GPU peak memory and bytes sent per step against world size.

The formulas count model states only (no activations, no gathered units): ZeRO-3 (Rajbhandari et al., 2020)
``16 P / N`` bytes per GPU with mixed-precision Adam (2 + 2 bytes of fp16 parameters and gradients, 12 of fp32
master weights, momentum and variance); FSDP2 with a bf16 ``MixedPrecisionPolicy`` keeps fp32 sharded
parameters, fp32 gradient shards and AdamW's two fp32 states (``16 P / N``) plus the bf16 unsharded parameters
of the block being computed and the one prefetched (``2 x 2 P_block``).

Usage: ``python benchmarks/estimate_llama.py [--worlds 8,16,32,64,128,256,512]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_output import pyplot, save_figure, utc_now, write_json

from flatshard.estimator import estimate, format_bytes, format_table
from flatshard.testing.llama import CONFIGS, LlamaBlock, llama

OUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "estimate"
SIZES = ("1b", "8b", "70b")
TABLE_WORLDS = (8, 64, 512)
SETTINGS: dict[str, Any] = {
    "sharding_strategy": "FULL_SHARD",
    "auto_wrap_policy": {LlamaBlock},
    "activation_checkpointing_policy": {LlamaBlock},
    "mixed_precision": {"param_dtype": "bf16"},
    "optimizer": "adamw",
    "bandwidth": "infiniband",
}


def _factory(size: str) -> Any:
    def build() -> Any:
        return llama(size)

    build.__qualname__ = f"llama_{size}"
    return build


def _counts(size: str) -> tuple[int, int]:
    """(parameters, parameters of one block) from the config (no model is built)."""
    cfg = CONFIGS[size]
    head = cfg.dim // cfg.n_heads
    block = cfg.dim * head * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    embeddings = cfg.vocab * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * block + embeddings + cfg.dim, block


def formulas(size: str, world: int) -> dict[str, int]:
    total, block = _counts(size)
    return {"zero3": 16 * total // world, "fsdp2": 16 * total // world + 2 * 2 * block}


def _md_table(size: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"**Llama {size.upper()}** ({_counts(size)[0] / 1e9:.2f}B parameters)",
        "",
        "| GPUs | flatshard: shards + grads + optimizer | flatshard: peak (estimate) | FSDP2 formula | ZeRO-3 formula "
        "| all-gather + reduce-scatter per GPU | exposed comm. / step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        states = r["params"] + r["grads"] + r["optimizer"]
        f = formulas(size, r["world_size"])
        comm = sum(r["comm"].values())
        lines.append(
            f"| {r['world_size']} | {format_bytes(states)} | {format_bytes(r['peak'])}{'' if r['fits'] else ' (no fit)'} "
            f"| {format_bytes(f['fsdp2'])} | {format_bytes(f['zero3'])} | {format_bytes(comm)} "
            f"| {r['exposed_s'] * 1e3:.0f} ms of {r['step_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,16,32,64,128,256,512")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    worlds = sorted({int(w) for w in args.worlds.split(",")} | set(TABLE_WORLDS))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": utc_now(),
        "settings": {k: repr(v) for k, v in SETTINGS.items()},
        "models": {},
    }
    tables = []
    for size in SIZES:
        start = time.perf_counter()
        est = estimate(_factory(size), worlds, **SETTINGS)
        rows = [dict(r.__dict__, fits=r.fits) for r in est.rows]
        for row in rows:
            row["formulas"] = formulas(size, row["world_size"])
        report["models"][size] = rows
        print(f"llama {size}: {len(worlds)} world sizes in {time.perf_counter() - start:.1f}s")
        shown = estimate(_factory(size), TABLE_WORLDS, **SETTINGS)
        tables.append(_md_table(size, [r for r in rows if r["world_size"] in TABLE_WORLDS]))
        tables.append(
            "```text\n$ flatshard estimate flatshard.testing.llama:llama_" + size + " -n 8,64,512 --wrap "
            "LlamaBlock --checkpoint LlamaBlock --mixed-precision bf16 --bandwidth infiniband\n"
            + format_table(shown).replace(f"llama_{size}", f"flatshard.testing.llama:llama_{size}")
            + "\n```"
        )
    write_json(args.out / "llama.json", report, default=str)
    (args.out / "tables.txt").write_text("\n\n".join(tables) + "\n")
    _plots(report, worlds, args.out)
    print(f"wrote {args.out}/llama.json, tables.txt, memory.png, communication.png")


def _plots(report: dict[str, Any], worlds: list[int], out: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SIZES), figsize=(12, 3.6), sharex=True)
    for ax, size in zip(axes, SIZES, strict=True):
        rows = report["models"][size]
        gib = 2**30
        ax.plot(worlds, [r["peak"] / gib for r in rows], "o-", label="flatshard estimate: peak")
        ax.plot(
            worlds,
            [(r["params"] + r["grads"] + r["optimizer"]) / gib for r in rows],
            "s-",
            label="flatshard: shards + grads + optimizer",
        )
        ax.plot(worlds, [r["formulas"]["fsdp2"] / gib for r in rows], "--", label="FSDP2 formula")
        ax.plot(worlds, [r["formulas"]["zero3"] / gib for r in rows], ":", label="ZeRO-3 formula")
        ax.axhline(80, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Llama {size.upper()}", fontsize=9)
        ax.set_xlabel("GPUs")
    axes[0].set_ylabel("GiB per GPU (line: 80 GiB)")
    axes[-1].legend(fontsize=7)
    save_figure(
        fig,
        out / "memory.png",
        "Per-GPU memory against world size (bf16, AdamW, checkpointing, 4k tokens/GPU)",
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for size in SIZES:
        rows = report["models"][size]
        axes[0].plot(
            worlds,
            [sum(r["comm"].values()) / 2**30 for r in rows],
            "o-",
            label=f"{size.upper()} into collectives",
        )
        axes[0].plot(worlds, [r["wire"] / 2**30 for r in rows], "--", label=f"{size.upper()} on the links")
        axes[1].plot(worlds, [r["exposed_s"] for r in rows], "o-", label=f"{size.upper()} exposed")
        axes[1].plot(worlds, [r["compute_s"] for r in rows], ":", label=f"{size.upper()} compute")
    axes[0].set_ylabel("GiB per GPU per step")
    axes[1].set_ylabel("seconds per step")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.legend(fontsize=7)
    save_figure(
        fig,
        out / "communication.png",
        "Step communication against world size (InfiniBand 50 GB/s per GPU, 400 TFLOP/s)",
    )


if __name__ == "__main__":
    main()
