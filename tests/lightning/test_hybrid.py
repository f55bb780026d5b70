"""Hybrid sharding through the Trainer: 4 gloo ranks set up as 2 nodes x 2 devices (the environment
Lightning reads on a real cluster), HYBRID_SHARD and HYBRID_SHARD_ZERO2 against DDP on the same nodes."""

from __future__ import annotations

import os
from typing import Any

import pytest

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    load_ckpt,
    make_loader,
    make_trainer,
)

pytestmark = pytest.mark.slow

STEPS = 3
NODES, PER_NODE = 2, 2

CASES: dict[str, Any] = {
    "ddp": lambda: "ddp",
    "hybrid": lambda: "flatshard_hybrid",  # default groups: shard within a node
    "hybrid_zero2": lambda: flatshard.FlatShardStrategy(
        sharding_strategy="HYBRID_SHARD_ZERO2", auto_wrap_policy={Block}
    ),
    "hybrid_mesh": lambda: flatshard.FlatShardStrategy(
        sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}, device_mesh=(NODES, PER_NODE)
    ),
}


def _train(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    os.environ.update({"NODE_RANK": str(rank // PER_NODE), "LOCAL_RANK": str(rank % PER_NODE)})
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # the Trainer knows the devices per node itself
    return _fit_cases(CASES, world, out_dir, "", PER_NODE, num_nodes=NODES)


def _fit_cases(
    cases: dict[str, Any], world: int, out_dir: str, prefix: str, devices: int, **trainer_kwargs: Any
) -> dict[str, Any]:
    """Fit each case on the same data, save ``{prefix}{name}.ckpt``; losses, rank and groups per case."""
    results: dict[str, Any] = {}
    for name, make in cases.items():
        model = LitGPT()
        recorder = LossRecorder()
        trainer = make_trainer(devices, make(), max_epochs=1, callbacks=[recorder], **trainer_kwargs)
        trainer.fit(model, make_loader(STEPS, 2 * world, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{prefix}{name}.ckpt"))
        info: dict[str, Any] = {"losses": recorder.losses, "global_rank": trainer.global_rank}
        if name != "ddp":
            handles = [h for s in unit_states(model) for h in s.handles]
            info["groups"] = sorted({(h.shard_world, h.replicate_world) for h in handles})
        results[name] = info
    return results


@pytest.mark.timeout(600)
def test_hybrid_through_the_trainer_matches_ddp(tmp_path: Any) -> None:
    ranks = spawn(_train, NODES * PER_NODE, str(tmp_path))
    assert [r["ddp"]["global_rank"] for r in ranks] == [0, 1, 2, 3]
    ddp = load_ckpt(tmp_path / "ddp.ckpt")
    for name in ("hybrid", "hybrid_zero2", "hybrid_mesh"):
        for r in ranks:
            assert r[name]["groups"] == [(PER_NODE, NODES)], (name, r[name]["groups"])
            for a, b in zip(r[name]["losses"], ranks[0]["ddp"]["losses"], strict=True):
                assert abs(a - b) <= 1e-5, (name, r[name]["losses"], ranks[0]["ddp"]["losses"])
        ckpt = load_ckpt(tmp_path / f"{name}.ckpt")
        assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs ddp")
        assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs ddp")


ONE_NODE: dict[str, Any] = {
    "ddp": lambda: "ddp",
    "hybrid": lambda: "flatshard_hybrid",  # one node of 4 devices: the default shard group is the node
    "hybrid_zero2": lambda: flatshard.FlatShardStrategy(
        sharding_strategy="HYBRID_SHARD_ZERO2", auto_wrap_policy={Block}
    ),
    "hybrid_one_rank_groups": lambda: flatshard.FlatShardStrategy(
        sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}, shard_group_size=1
    ),
}


def _train_one_node(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    os.environ.update({"NODE_RANK": "0", "LOCAL_RANK": str(rank)})
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    return _fit_cases(ONE_NODE, world, out_dir, "one_node_", world)


@pytest.mark.timeout(600)
def test_hybrid_on_one_node_matches_ddp(tmp_path: Any) -> None:
    """The config a user runs on many nodes runs on one: as FULL_SHARD / SHARD_GRAD_OP, or NO_SHARD."""
    ranks = spawn(_train_one_node, 4, str(tmp_path))
    ddp = load_ckpt(tmp_path / "one_node_ddp.ckpt")
    expected_groups = {"hybrid": [(4, 1)], "hybrid_zero2": [(4, 1)], "hybrid_one_rank_groups": [(1, 4)]}
    for name, groups in expected_groups.items():
        for r in ranks:
            assert r[name]["groups"] == groups, (name, r[name]["groups"])
            for a, b in zip(r[name]["losses"], ranks[0]["ddp"]["losses"], strict=True):
                assert abs(a - b) <= 1e-5, (name, r[name]["losses"], ranks[0]["ddp"]["losses"])
        ckpt = load_ckpt(tmp_path / f"one_node_{name}.ckpt")
        assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs ddp")
        assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs ddp")
