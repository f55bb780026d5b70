"""A Trainer script started by a real launcher (``torchrun`` or SLURM-style plain processes), not by
``flatshard.testing.spawn``: ``tests/lightning/test_cluster_launch.py`` runs it as a user would.

    python tests/lightning/_cluster_train.py --env torchelastic --strategies ddp,flatshard --out DIR

Every process reads its ranks from the launcher's environment (through Lightning's cluster environment),
fits ``LitGPT`` once per strategy in sequence on the same data (``lit_common.make_loader``: the same global
batch on any world size), saves ``DIR/<strategy>.ckpt`` with ``trainer.save_checkpoint`` and writes
``DIR/rank<global rank>.json``: the cluster environment, its ranks and main address, the launcher
variables (as the process started), per strategy
the recorded losses and flatshard's groups. It also asserts what it can check locally (the environment
class, ranks 0..N-1 across the world, shard groups within a node and replicate groups across nodes), so a
wrong launch fails the run with a traceback. The repository root must be on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import flatshard  # registers the strategy names
from flatshard.engine import unit_states
from tests.lightning.lit_common import LitGPT, LossRecorder, make_loader, make_trainer

ENVIRONMENTS = {"torchelastic": "TorchElasticEnvironment", "slurm": "SLURMEnvironment"}
STRATEGIES = ("ddp", "flatshard", "flatshard_hybrid")
LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NODELIST",
    "CLUSTER_TEST_INVOCATION",  # which launcher invocation (torchrun "node") started this process
)


def _groups(model: torch.nn.Module, node_of_rank: list[int]) -> dict[str, Any]:
    """Each unit's (shard_world, replicate_world), and the nodes its shard / replicate groups span."""
    handles = [h for s in unit_states(model) for h in s.handles]
    assert handles, "no flatshard unit holds parameters: was the model sharded?"

    def nodes(group: Any) -> list[int]:
        ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        return [node_of_rank[r] for r in ranks]

    return {
        "worlds": sorted({(h.shard_world, h.replicate_world) for h in handles}),
        "shard_nodes": sorted({tuple(nodes(h.shard_group)) for h in handles}),
        "replicate_nodes": sorted({tuple(nodes(h.replicate_group)) for h in handles}),
    }


def _check_groups(name: str, groups: dict[str, Any], world: int, per_node: int, my_node: int) -> None:
    nodes = world // per_node
    if name == "flatshard_hybrid":  # default groups: shard within a node, replicate across the nodes
        assert groups["worlds"] == [(per_node, nodes)], groups
        assert groups["shard_nodes"] == [(my_node,) * per_node], groups
        assert groups["replicate_nodes"] == [tuple(range(nodes))], groups
    else:  # FULL_SHARD over the whole world
        assert groups["worlds"] == [(world, 1)], groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=sorted(ENVIRONMENTS), required=True)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds; then dump stacks and exit")
    args = parser.parse_args()
    # A rank stuck in a collective (a peer died) must not outlive the test: dump every stack and exit.
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    torch.set_num_threads(1)
    world = args.num_nodes * args.devices

    record: dict[str, Any] = {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in LAUNCH_VARIABLES}}
    node_of_rank: list[int] = []
    for name in args.strategies.split(","):
        assert name in STRATEGIES, name
        model = LitGPT()
        recorder = LossRecorder()
        trainer = make_trainer(
            args.devices, name, num_nodes=args.num_nodes, max_epochs=1, callbacks=[recorder]
        )
        env = trainer.strategy.cluster_environment
        assert type(env).__name__ == ENVIRONMENTS[args.env], type(env)
        trainer.fit(model, make_loader(args.steps, 2 * world, world))
        trainer.save_checkpoint(os.path.join(args.out, f"{name}.ckpt"))

        ranks = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "dist_rank": dist.get_rank(),
            "dist_world": dist.get_world_size(),
        }
        assert ranks["global_rank"] == ranks["dist_rank"] == env.global_rank(), ranks
        assert ranks["world_size"] == ranks["dist_world"] == env.world_size() == world, ranks
        assert ranks["global_rank"] == ranks["node_rank"] * args.devices + ranks["local_rank"], ranks
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (ranks["global_rank"], ranks["node_rank"]))
        assert sorted(r for r, _ in everyone) == list(range(world)), everyone
        node_of_rank = [n for _, n in sorted(everyone)]
        assert node_of_rank == [r // args.devices for r in range(world)], everyone

        case: dict[str, Any] = {"losses": recorder.losses, **ranks}
        if name != "ddp":
            assert isinstance(trainer.strategy, flatshard.FlatShardStrategy), type(trainer.strategy)
            case["groups"] = _groups(model, node_of_rank)
            _check_groups(name, case["groups"], world, args.devices, ranks["node_rank"])
        record[name] = case
        record["cluster_environment"] = type(env).__name__
        record["main_address"] = [env.main_address, env.main_port]  # as the process group was set up
        record["global_rank"] = ranks["global_rank"]
        record["node_rank"] = ranks["node_rank"]
        record["local_rank"] = ranks["local_rank"]

    path = os.path.join(args.out, f"rank{record['global_rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
