"""``flatshard estimate`` for Llama 3 shapes (1B, 8B, 70B) at 8 to 512 GPUs, beside FSDP2's and ZeRO-3's formulas.

No GPU and no weights: the estimator builds the models on the meta device (``flatshard.testing.llama``) with a
typical run's settings: FULL_SHARD, one unit per block, bf16 compute and reduction, AdamW, activation checkpointing
per block, one 4,096-token sequence per GPU, InfiniBand between ranks. The formulas count model states only: ZeRO-3
``16 P / N`` bytes per GPU, FSDP2 with a bf16 policy ``16 P / N`` plus the bf16 unsharded block computed and the one
prefetched (``2 x 2 P_block``). Besides the report, ``estimate_llama.md`` holds the tables ``docs/estimate.md``
includes.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..report import Column, Panel
from ..schema import Report, Row

PRESETS = ("llama",)
CONTENDERS = ("flatshard",)
DEFAULT_CONTENDERS = CONTENDERS
SIZES = ("1b", "8b", "70b")
TABLE_WORLDS = (8, 64, 512)
RATIOS: tuple[str, ...] = ()
COLUMNS = [
    Column("GPUs", "gpus", "d"),
    Column("shards + grads + optimizer GiB", "states_gib", ".2f"),
    Column("peak GiB (estimate)", "peak_gib", ".2f"),
    Column("FSDP2 formula GiB", "fsdp2_formula_gib", ".2f"),
    Column("ZeRO-3 formula GiB", "zero3_formula_gib", ".2f"),
    Column("into collectives GiB/step", "comm_gib", ".2f"),
    Column("exposed comm. s/step", "exposed_s", ".3f"),
    Column("step s", "step_s", ".3f"),
]
PANELS = [
    Panel("GiB per GPU", ("peak_gib", "fsdp2_formula_gib"), x="gpus", log=True),
    Panel("GiB into collectives per GPU and step", ("comm_gib",), x="gpus", log=True),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", default="8,16,32,64,128,256,512", help="GPU counts")


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    worlds = sorted({int(w) for w in args.worlds.split(",")} | set(TABLE_WORLDS))
    return {"worlds": worlds, "settings": _settings_text(), "device": "cpu"}, ""


def _settings() -> dict[str, Any]:
    from flatshard.testing.llama import LlamaBlock

    return {
        "sharding_strategy": "FULL_SHARD",
        "auto_wrap_policy": {LlamaBlock},
        "activation_checkpointing_policy": {LlamaBlock},
        "mixed_precision": {"param_dtype": "bf16"},
        "optimizer": "adamw",
        "bandwidth": "infiniband",
    }


def _settings_text() -> dict[str, str]:
    return {k: repr(v) for k, v in _settings().items()}


def _counts(size: str) -> tuple[int, int]:
    """(parameters, parameters of one block) from the config (no model is built)."""
    from flatshard.testing.llama import CONFIGS

    cfg = CONFIGS[size]
    head = cfg.dim // cfg.n_heads
    block = cfg.dim * head * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    return cfg.n_layers * block + cfg.vocab * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim, block


def _factory(size: str) -> Any:
    from flatshard.testing.llama import llama

    def build() -> Any:
        return llama(size)

    build.__qualname__ = f"llama_{size}"
    return build


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    from flatshard.estimator import estimate

    rows = []
    gib = 2**30
    for size in SIZES:
        total, block = _counts(size)
        for r in estimate(_factory(size), cfg["worlds"], **_settings()).rows:
            n = r.world_size
            metrics = {
                "gpus": n,
                "states_gib": (r.params + r.grads + r.optimizer) / gib,
                "peak_gib": r.peak / gib,
                "fits": r.fits,
                "fsdp2_formula_gib": (16 * total // n + 4 * block) / gib,
                "zero3_formula_gib": 16 * total // n / gib,
                "comm_gib": sum(r.comm.values()) / gib,
                "wire_gib": r.wire / gib,
                "exposed_s": r.exposed_s,
                "step_s": r.step_s,
                "compute_s": r.compute_s,
                "series": f"Llama {size.upper()}",
            }
            rows.append(
                Row(name=f"llama-{size} N={n}", contender="flatshard", label=size, metrics=metrics, runs=[])
            )
    return rows, []


def extra_text(report: Report) -> str:
    """The Markdown ``docs/estimate.md`` includes: per size a table at 8, 64 and 512 GPUs and the CLI's output."""
    from flatshard.estimator import estimate, format_bytes, format_table

    gib = 2**30
    parts = []
    for size in SIZES:
        head = "| GPUs | flatshard: shards + grads + optimizer | flatshard: peak (estimate) | FSDP2 formula "
        head += "| ZeRO-3 formula | all-gather + reduce-scatter per GPU | exposed comm. / step |"
        lines = [
            f"**Llama {size.upper()}** ({_counts(size)[0] / 1e9:.2f}B parameters)",
            "",
            head,
            "|---:" * 7 + "|",
        ]
        for r in report.rows:
            m = r.metrics
            if r.label == size and m["gpus"] in TABLE_WORLDS:
                cells = [str(m["gpus"])] + [
                    format_bytes(int(m[k] * gib)) for k in ("states_gib", "peak_gib", "fsdp2_formula_gib")
                ]
                cells[2] += "" if m["fits"] else " (no fit)"
                cells += [
                    format_bytes(int(m["zero3_formula_gib"] * gib)),
                    format_bytes(int(m["comm_gib"] * gib)),
                ]
                cells.append(f"{m['exposed_s'] * 1e3:.0f} ms of {m['step_s'] * 1e3:.0f} ms")
                lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
        lines = _cross_node_table(size)
        cli = format_table(estimate(_factory(size), TABLE_WORLDS, **_settings()))
        cli = cli.replace(f"llama_{size}", f"flatshard.testing.llama:llama_{size}")
        command = f"$ flatshard estimate flatshard.testing.llama:llama_{size} -n 8,64,512 --wrap LlamaBlock "
        command += "--checkpoint LlamaBlock --mixed-precision bf16 --bandwidth infiniband"
        parts += ["\n".join(lines), f"```text\n{command}\n{cli}\n```"]
    return "\n\n".join(parts) + "\n"


CROSS_WORLDS = (64, 512)
MICRO_BATCHES = 4


def _cross_node_table(size: str) -> list[str]:
    """Bytes each GPU puts on links between nodes (8 GPUs per node) per optimizer step of 4 micro-batches: FULL_SHARD
    with and without the node-local copy for backward, hybrid sharding with the all-reduce across replicas every
    micro-batch (as before) and once per step (see [Note: bytes between nodes])."""
    from flatshard.estimator import estimate, format_bytes

    settings = {**_settings(), "micro_batches": MICRO_BATCHES, "ranks_per_node": 8}
    full = estimate(_factory(size), CROSS_WORLDS, **settings).rows
    local = estimate(_factory(size), CROSS_WORLDS, reshard_after_forward=8, **settings).rows
    hybrid_settings = {**settings, "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 8}
    hybrid = estimate(_factory(size), CROSS_WORLDS, **hybrid_settings).rows
    lines = [
        f"Between nodes, Llama {size.upper()}: bytes per GPU and optimizer step of {MICRO_BATCHES} micro-batches, "
        "8 GPUs per node (ring upper bound)",
        "",
        "| GPUs | FULL_SHARD | FULL_SHARD, `reshard_after_forward=8` | HYBRID_SHARD (8 per node), all-reduce every "
        "micro-batch | HYBRID_SHARD, all-reduce once per step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for f, n, h in zip(full, local, hybrid, strict=True):
        every = (
            h.cross_node * MICRO_BATCHES
        )  # the all-reduce across replicas is the only traffic between nodes
        cells = [str(f.world_size)] + [
            format_bytes(v) for v in (f.cross_node, n.cross_node, every, h.cross_node)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
