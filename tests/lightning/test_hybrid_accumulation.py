"""The Trainer's ``accumulate_grad_batches`` under hybrid sharding (4 CPU ranks as 2 "nodes" of 2): the same losses
and weights as DDP, and the gradient shards cross the replicate group (between nodes) once per optimizer step,
for both ``grad_accumulation`` modes (see [Note: replica reductions once per step]); and FULL_SHARD with
``reshard_after_forward=2`` (see [Note: a node-local copy for backward])."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.transport import groups
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, LossRecorder, make_loader, make_trainer

STEPS = 8  # batches per epoch; 2 optimizer steps of 4 micro-batches
GLOBAL_BATCH = 8
MICRO = 4


class _Bytes(L.Callback):
    """Bytes this rank sent into the replicate group's all-reduces, per optimizer step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._last = 0

    def _sent(self, module: L.LightningModule) -> int:
        handles = [h for s in unit_states(module) for h in s.handles]
        return int(groups.state_of(handles[0].replicate_group).sent["all_reduce"])

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last = self._sent(module)  # the group's count goes on across fits in one process

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        sent = self._sent(module)
        self.per_step.append(sent - self._last)
        self._last = sent


class _Switch(L.Callback):
    """Between steps, from a callback: the node-local copy from the second optimizer step on."""

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if idx == MICRO:
            flatshard.set_reshard_after_forward(module, 2)


def _fit(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in ("ddp", "sharded", "no_sync", "node_copy", "switched"):
        recorder, counted = LossRecorder(), _Bytes()
        strategy: Any = "ddp"
        if name == "node_copy":  # FULL_SHARD over the 4 ranks, backward gathering inside each "node" of 2
            strategy = flatshard.FlatShardStrategy(auto_wrap_policy={Block}, reshard_after_forward=2)
        elif name == "switched":
            strategy = flatshard.FlatShardStrategy(auto_wrap_policy={Block})
        elif name != "ddp":
            strategy = flatshard.FlatShardStrategy(
                auto_wrap_policy={Block},
                sharding_strategy="HYBRID_SHARD",
                shard_group_size=2,
                grad_accumulation=name,
            )
        module = LitGPT()
        callbacks = [recorder] + ([counted] if name in ("sharded", "no_sync") else [])
        callbacks += [_Switch()] if name == "switched" else []
        trainer = make_trainer(
            world, strategy, max_epochs=1, accumulate_grad_batches=MICRO, callbacks=callbacks
        )
        trainer.fit(module, make_loader(STEPS, GLOBAL_BATCH, world))
        weights = (
            flatshard.get_state_dict(module, rank0_only=False)[0]
            if name != "ddp"
            else {k: v.detach().clone() for k, v in module.state_dict().items()}
        )
        shard_bytes = 0
        if name != "ddp":
            shard_bytes = sum(h._grad_numel * 4 for s in unit_states(module) for h in s.handles)
        out[name] = {
            "losses": recorder.losses,
            "weights": weights,
            "bytes": counted.per_step,
            "shard": shard_bytes,
            "node_groups": sum(s.node_group is not None for s in unit_states(module)) if name != "ddp" else 0,
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_hybrid_accumulation_matches_ddp_and_crosses_nodes_once_per_step() -> None:
    for rank, r in enumerate(spawn(_fit, 4)):
        ddp = r["ddp"]
        for name in ("sharded", "no_sync"):
            got = r[name]
            assert got["losses"] == pytest.approx(ddp["losses"], abs=1e-5), (rank, name)
            for k, v in ddp["weights"].items():
                torch.testing.assert_close(got["weights"][k], v, atol=2e-5, rtol=0, msg=f"{rank} {name} {k}")
            # one all-reduce of each unit's gradient shard per optimizer step (plus the small flag all-reduce)
            assert len(got["bytes"]) == STEPS // MICRO, (rank, name, got["bytes"])
            assert all(got["shard"] <= b < got["shard"] + 1024 for b in got["bytes"]), (rank, name, got)
        for name in ("node_copy", "switched"):
            got = r[name]
            assert got["losses"] == pytest.approx(ddp["losses"], abs=1e-5), (rank, name)
            for k, v in ddp["weights"].items():
                torch.testing.assert_close(got["weights"][k], v, atol=2e-5, rtol=0, msg=f"{rank} {name} {k}")
            assert got["node_groups"] > 0, (
                rank,
                name,
            )  # the copy was in use (switched: from the callback on)
