"""Bytes per training step by collective and process group: FULL_SHARD over all ranks vs hybrid sharding.

Four gloo ranks play 2 nodes x 2 devices. Each contender trains the GPT of ``examples/gpt/model.py``
(one unit per block, AdamW) for ``--steps`` steps; flatshard's comm layer counts the bytes each rank puts
into every collective (``flatshard.engine.transport.comm.comm_stats``). Under HYBRID_SHARD the all-gathers and
reduce-scatters stay inside a node (the shard group) and only the all-reduce of gradient shards crosses
nodes (the replicate group); under FULL_SHARD every collective spans both nodes. The table reports bytes
per rank per step, and the bytes that cross the node boundary per step relative to FULL_SHARD's.

    python benchmarks/hybrid_traffic.py                 # writes docs/bench/hybrid_traffic.json
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from bench_measure import MIB
from bench_model import GPT, Block, GPTConfig
from bench_output import default_out, utc_now, write_json

import flatshard
from flatshard.engine.transport import comm
from flatshard.testing import spawn


def run(rank: int, world: int, strategy: str, cfg: dict[str, Any]) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=cfg["vocab"],
            block_size=cfg["seq"],
            n_layer=cfg["layers"],
            n_head=8,
            d_model=cfg["d_model"],
        )
    )
    kwargs: dict[str, Any] = {"sharding_strategy": strategy, "auto_wrap_policy": {Block}}
    if strategy.startswith("HYBRID"):
        kwargs["shard_group_size"] = cfg["per_node"]
    flatshard.shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    losses = []
    comm.comm_stats.clear()
    for _ in range(cfg["steps"]):
        tokens = torch.randint(0, cfg["vocab"], (2 * world, cfg["seq"] + 1), generator=g)[
            2 * rank : 2 * rank + 2
        ]
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    steps = cfg["steps"]
    out = {kind: comm.comm_stats[kind] / steps for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    out["loss"] = losses[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=default_out("hybrid_traffic.json"))
    args = parser.parse_args(argv)
    cfg = {
        "d_model": args.d_model,
        "layers": args.layers,
        "vocab": 8192,
        "seq": 64,
        "steps": args.steps,
        "per_node": 2,
    }
    world = 4
    results: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        ranks = spawn(run, world, strategy, cfg)
        r0 = ranks[0]
        # Across nodes: every FULL_SHARD collective spans both nodes; for hybrid only the replicate all-reduce.
        cross = (r0["all_gather"] + r0["reduce_scatter"]) if strategy == "FULL_SHARD" else r0["all_reduce"]
        results[strategy] = {**r0, "cross_node": cross, "losses": [r["loss"] for r in ranks]}
    base = results["FULL_SHARD"]["cross_node"]
    for r in results.values():
        r["cross_node_vs_full_shard"] = r["cross_node"] / base
    print(
        "| strategy | all-gather MiB | reduce-scatter MiB | all-reduce MiB | across nodes MiB | vs FULL_SHARD |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['all_gather'] / MIB:.1f} | {r['reduce_scatter'] / MIB:.1f} | {r['all_reduce'] / MIB:.1f} "
            f"| {r['cross_node'] / MIB:.1f} | {r['cross_node_vs_full_shard']:.2f}x |"
        )
    record = {
        "date": utc_now(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "command": "python benchmarks/hybrid_traffic.py " + " ".join(argv or sys.argv[1:]),
        "config": cfg,
        "world_size": world,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
