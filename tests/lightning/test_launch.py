"""Registration of the strategy names, and the spawn launcher variant end to end."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import flatshard
from flatshard.engine import ShardingStrategy

from .lit_common import LitGPT, assert_same_weights, make_loader, make_trainer, train_reference

NAMES = ["flatshard", "flatshard_grad_op", "flatshard_hybrid", "flatshard_offload"]


def test_names_registered_for_trainer_and_fabric_and_registering_again_is_harmless() -> None:
    flatshard.lightning.register()
    flatshard.lightning.register()
    for name in NAMES:
        assert name in StrategyRegistry and name in FABRIC_REGISTRY, name
    trainer = make_trainer(1, "flatshard_grad_op")
    assert isinstance(trainer.strategy, flatshard.FlatShardStrategy)
    assert trainer.strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP


def test_names_build_hybrid_and_offloading_strategies() -> None:
    hybrid = make_trainer(1, "flatshard_hybrid").strategy
    offload = make_trainer(1, "flatshard_offload").strategy
    assert hybrid.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert offload.options.shard.cpu_offload is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spawn_launcher_trains_and_returns_full_weights_to_the_main_process() -> None:
    steps, global_batch = 3, 4
    _, reference, _ = train_reference(steps, global_batch)
    model = LitGPT()
    trainer = make_trainer(2, flatshard.FlatShardStrategy(start_method="spawn"), max_epochs=1)
    trainer.fit(model, make_loader(steps, global_batch, 2))
    # The main process never sharded its copy: it received rank 0's consolidated weights.
    assert not flatshard.is_sharded(model)
    assert all(p.shape == q.shape for p, q in zip(model.parameters(), reference.parameters()))
    assert_same_weights(model.state_dict(), reference.state_dict(), "spawn launcher vs 1 device")
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
