"""Trainer parity: flatshard (every sharding mode) trains exactly like DDP and like one device.

One spawn per world size runs every strategy in turn inside the same ranks (process start-up dominates the
cost). Each run writes its consolidated checkpoint with ``trainer.save_checkpoint``; the comparisons read
those files with plain ``torch.load`` in the pytest process. The optimizer state is compared too: AdamW's
update is almost invariant to the scale of the gradient, so weights alone would not notice gradients that
were summed instead of averaged over ranks, but ``exp_avg`` would.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.setup.activation_checkpointing import is_checkpointed
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT

from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    load_ckpt,
    make_loader,
    make_trainer,
    train_reference,
)

STEPS = 4
N_BLOCKS = 3  # TinyGPT's default n_layer


class FrozenGPT(LitGPT):
    """Part of the model frozen (inside the same unit as trainable parameters); the optimizer skips it."""

    FROZEN = ("model.wpe.weight", "model.blocks.1.ln1.weight")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, p in self.named_parameters():
            p.requires_grad_(name not in self.FROZEN)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.1)


class ValidatedFirstGPT(LitGPT):
    """Shape-grouped AdamW, validated (by another Trainer, which shards it) before it is fitted: the optimizer
    is then built on an already sharded model."""

    validate_first = True

    def __init__(self) -> None:
        super().__init__(optimizer="groups")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model.loss(batch[0], batch[1])
        self.log("val_loss", loss, sync_dist=True)
        return loss


class SkipLastBlockGPT(LitGPT):
    """The last block takes no part in the loss: its parameters get no gradient (``None``) in plain PyTorch,
    so AdamW neither decays them nor creates state for them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, target = batch
        m = self.model
        h = m.wte(idx) + m.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in m.blocks[:-1]:
            h = blk(h)
        logits = m.head(m.ln_f(h))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


def _per_rank_seed(rank: int) -> LitGPT:
    return LitGPT(seed=rank)  # different weights on every rank: sync_module_states must broadcast rank 0's


# name -> (strategy factory, module factory(rank), extra Trainer arguments)
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "ddp": (lambda: "ddp", lambda rank: LitGPT(), {}),
    "flatshard": (lambda: "flatshard", lambda rank: LitGPT(), {}),
    "flatshard_block": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: LitGPT(),
        {},
    ),
    "flatshard_grad_op": (lambda: "flatshard_grad_op", lambda rank: LitGPT(), {}),
    "no_shard": (
        lambda: flatshard.FlatShardStrategy(sharding_strategy="NO_SHARD"),
        lambda rank: LitGPT(),
        {},
    ),
    # Lightning features on top of the same training:
    "ddp_accumulate": (lambda: "ddp", lambda rank: LitGPT(), {"accumulate_grad_batches": 2}),
    "flatshard_accumulate": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: LitGPT(),
        {"accumulate_grad_batches": 2},
    ),
    "flatshard_accumulate_no_sync": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}, grad_accumulation="no_sync"),
        lambda rank: LitGPT(),
        {"accumulate_grad_batches": 2},
    ),
    # A root unit of 8.4 MB: its gradient shards (4.2 MB) are mapped blocks, which accumulate like heap ones
    # (SGD: AdamW would turn rounding differences of near-zero gradients into 1e-5 weight differences).
    "ddp_accumulate_wide": (
        lambda: "ddp",
        lambda rank: LitGPT(vocab=8192, d_model=256, optimizer="sgd", lr=0.5),
        {"accumulate_grad_batches": 2},
    ),
    "flatshard_accumulate_wide": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: LitGPT(vocab=8192, d_model=256, optimizer="sgd", lr=0.5),
        {"accumulate_grad_batches": 2},
    ),
    "flatshard_offload": (lambda: "flatshard_offload", lambda rank: LitGPT(), {}),
    "flatshard_checkpoint_units": (
        lambda: flatshard.FlatShardStrategy(
            auto_wrap_policy={Block}, activation_checkpointing_policy={Block}
        ),
        lambda rank: LitGPT(),
        {},
    ),
    "flatshard_checkpoint_inside": (  # checkpointed blocks inside the one root unit, policy from a YAML-style path
        lambda: flatshard.FlatShardStrategy(
            activation_checkpointing_policy=["flatshard.testing.models.Block"]
        ),
        lambda rank: LitGPT(),
        {},
    ),
    # configure_optimizers groups by p.ndim: it must see the original shapes, not the shards' pieces
    "ddp_groups": (lambda: "ddp", lambda rank: LitGPT(optimizer="groups"), {}),
    "flatshard_groups": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: LitGPT(optimizer="groups"),
        {},
    ),
    "flatshard_groups_sharded_first": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: ValidatedFirstGPT(),
        {},
    ),
    # Adagrad creates its state in its constructor: it is cut to each rank's piece
    "ddp_adagrad": (lambda: "ddp", lambda rank: LitGPT(optimizer="adagrad"), {}),
    "flatshard_adagrad": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: LitGPT(optimizer="adagrad"),
        {},
    ),
    "ddp_frozen": (lambda: "ddp", lambda rank: FrozenGPT(), {}),
    "flatshard_frozen": (lambda: "flatshard", lambda rank: FrozenGPT(), {}),
    "flatshard_sync_module_states": (
        lambda: flatshard.FlatShardStrategy(sync_module_states=True),
        _per_rank_seed,
        {},
    ),
    "ddp_unused": (lambda: DDPStrategy(find_unused_parameters=True), lambda rank: SkipLastBlockGPT(), {}),
    "flatshard_unused": (lambda: "flatshard", lambda rank: SkipLastBlockGPT(), {}),
    "flatshard_block_unused": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        lambda rank: SkipLastBlockGPT(),
        {},
    ),
}

EXPECTED = {  # name -> (ShardingStrategy name, number of units)
    "flatshard": ("FULL_SHARD", 1),
    "flatshard_block": ("FULL_SHARD", 1 + N_BLOCKS),
    "flatshard_grad_op": ("SHARD_GRAD_OP", 1),
    "no_shard": ("NO_SHARD", 1),
}


def _train_all(rank: int, world: int, names: list[str], per_rank: int, out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        make_strategy, make_module, extra = CASES[name]
        model = make_module(rank)
        if getattr(model, "validate_first", False):
            make_trainer(world, make_strategy()).validate(
                model, make_loader(1, per_rank * world, world), verbose=False
            )
        recorder = LossRecorder()
        trainer = make_trainer(world, make_strategy(), max_epochs=1, callbacks=[recorder], **extra)
        trainer.fit(model, make_loader(STEPS, per_rank * world, world))
        info: dict[str, Any] = {
            "losses": recorder.losses,
            "global_step": trainer.global_step,
            "strategy_class": type(trainer.strategy).__name__,
            "local_numel": sum(p.numel() for p in model.parameters()),
        }
        if not name.startswith("ddp"):
            assert trainer.model is model, "flatshard must shard in place, without a wrapper"
            info["sharding_strategy"] = trainer.strategy.sharding_strategy.name
            info["units"] = len(unit_states(model))
            info["param_shapes"] = [tuple(p.shape) for p in model.parameters()]
            info["checkpointed"] = sum(is_checkpointed(m) for m in model.modules())
        trainer.save_checkpoint(os.path.join(out_dir, f"{name}_w{world}.ckpt"))
        results[name] = info
    return results


@pytest.fixture(scope="module")
def single_device(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """1-device references for global batches 4 and 6: {global_batch: {losses, checkpoint}}."""
    out: dict[int, dict[str, Any]] = {}
    directory = tmp_path_factory.mktemp("single")
    for global_batch in (4, 6):
        trainer, _, recorder = train_reference(STEPS, global_batch)
        path = directory / f"auto_g{global_batch}.ckpt"
        trainer.save_checkpoint(path)
        out[global_batch] = {"losses": recorder.losses, "ckpt": load_ckpt(path), "steps": trainer.global_step}
    return out


# What the quick tier's tests of this module read (see tests/conftest.py); the rest of the matrix is slow.
QUICK_CASES = ["ddp", "flatshard"]


def _cases_to_train(request: pytest.FixtureRequest) -> list[str]:
    """Every case in one spawn; only the quick tier's cases when no slow test of this module is selected."""
    selected = [item for item in request.session.items if item.module is request.module]
    if any(item.get_closest_marker("slow") for item in selected):
        return list(CASES)
    return QUICK_CASES


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("two_ranks")
    names = _cases_to_train(request)
    per_rank = spawn(_train_all, 2, names, 2, str(directory))
    return {"ranks": per_rank, "ckpt": {n: load_ckpt(directory / f"{n}_w2.ckpt") for n in names}}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("three_ranks")
    names = ["flatshard", "flatshard_block"]
    per_rank = spawn(_train_all, 3, names, 2, str(directory))
    return {"ranks": per_rank, "ckpt": {n: load_ckpt(directory / f"{n}_w3.ckpt") for n in names}}


def _full_numel() -> int:
    return sum(p.numel() for p in TinyGPT().parameters())


@pytest.mark.timeout(300)
def test_ddp_matches_single_device(two_ranks: dict[str, Any], single_device: dict[int, Any]) -> None:
    """The reference itself: 2-rank DDP with batch 2 per rank equals 1 device with batch 4."""
    ddp, single = two_ranks["ckpt"]["ddp"], single_device[4]
    assert two_ranks["ranks"][0]["ddp"]["global_step"] == single["steps"] == STEPS
    assert_same_weights(ddp["state_dict"], single["ckpt"]["state_dict"], "ddp vs 1 device")
    assert_same_optimizer_state(
        ddp["optimizer_states"][0], single["ckpt"]["optimizer_states"][0], "ddp vs 1 device"
    )
    torch.testing.assert_close(two_ranks["ranks"][0]["ddp"]["losses"], single["losses"], atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    [
        "flatshard",
        pytest.param("flatshard_block", marks=pytest.mark.slow),
        pytest.param("flatshard_grad_op", marks=pytest.mark.slow),
        pytest.param("no_shard", marks=pytest.mark.slow),
    ],
)
def test_flatshard_matches_ddp_and_single_device(
    name: str, two_ranks: dict[str, Any], single_device: dict[int, Any]
) -> None:
    ckpt, ddp, single = two_ranks["ckpt"][name], two_ranks["ckpt"]["ddp"], single_device[4]
    ranks = [r[name] for r in two_ranks["ranks"]]
    # It really ran flatshard, in the requested mode, with the requested units.
    mode, units = EXPECTED[name]
    for info in ranks:
        assert info["strategy_class"] == "FlatShardStrategy"
        assert info["sharding_strategy"] == mode
        assert info["units"] == units
        assert info["global_step"] == STEPS
    if mode == "NO_SHARD":
        assert [r["local_numel"] for r in ranks] == [_full_numel()] * 2
        assert ranks[0]["param_shapes"] == [tuple(p.shape) for p in TinyGPT().parameters()]
    else:  # each rank holds about half of the parameters, as 1-D pieces
        assert sum(r["local_numel"] for r in ranks) == _full_numel()
        assert all(r["local_numel"] < _full_numel() for r in ranks)
        assert all(len(shape) == 1 for r in ranks for shape in r["param_shapes"])
    # Same weights, same optimizer state, same buffers, same logged losses.
    assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs ddp")
    assert_same_weights(ckpt["state_dict"], single["ckpt"]["state_dict"], f"{name} vs 1 device")
    assert int(ckpt["state_dict"]["model.steps"]) == STEPS
    assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs ddp")
    for info in ranks:  # synced: every rank holds the global mean loss
        torch.testing.assert_close(info["losses"], ranks[0]["losses"], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        ranks[0]["losses"], two_ranks["ranks"][0]["ddp"]["losses"], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(ranks[0]["losses"], single["losses"], atol=1e-5, rtol=1e-5)
    assert ckpt["global_step"] == ddp["global_step"] == STEPS


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["flatshard", "flatshard_block"])
def test_three_ranks_uneven_shards_match_single_device(
    name: str, three_ranks: dict[str, Any], single_device: dict[int, Any]
) -> None:
    """3 ranks x 2 samples vs 1 device x 6; TinyGPT's sizes do not divide by 3, so shards are padded."""
    ckpt, single = three_ranks["ckpt"][name], single_device[6]
    ranks = [r[name] for r in three_ranks["ranks"]]
    assert sum(r["local_numel"] for r in ranks) == _full_numel()
    assert all(r["units"] == EXPECTED[name][1] for r in ranks)
    assert_same_weights(ckpt["state_dict"], single["ckpt"]["state_dict"], f"{name} x3 vs 1 device")
    assert_same_optimizer_state(
        ckpt["optimizer_states"][0], single["ckpt"]["optimizer_states"][0], f"{name} x3 vs 1 device"
    )
    for info in ranks:
        assert info["global_step"] == STEPS
        torch.testing.assert_close(info["losses"], single["losses"], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Lightning features on top
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, reference",
    [
        ("flatshard_accumulate", "ddp_accumulate"),
        ("flatshard_accumulate_no_sync", "ddp_accumulate"),
        ("flatshard_accumulate_wide", "ddp_accumulate_wide"),
        ("flatshard_frozen", "ddp_frozen"),
        ("flatshard_groups", "ddp_groups"),
        ("flatshard_groups_sharded_first", "ddp_groups"),
        ("flatshard_adagrad", "ddp_adagrad"),
        ("flatshard_sync_module_states", "ddp"),
        ("flatshard_offload", "ddp"),
        ("flatshard_checkpoint_units", "ddp"),
        ("flatshard_checkpoint_inside", "ddp"),
    ],
)
def test_lightning_features_match_ddp(name: str, reference: str, two_ranks: dict[str, Any]) -> None:
    """Gradient accumulation (gradients of 2 micro-batches summed into the gradient shards), frozen
    parameters sharing a unit with trainable ones, and sync_module_states from rank 0 (ranks built different
    weights here; DDP broadcasts rank 0's too)."""
    ckpt, ddp = two_ranks["ckpt"][name], two_ranks["ckpt"][reference]
    assert ckpt["global_step"] == ddp["global_step"]
    assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs {reference}")
    assert_same_optimizer_state(
        ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs {reference}"
    )
    for info in (r[name] for r in two_ranks["ranks"]):
        torch.testing.assert_close(
            info["losses"], two_ranks["ranks"][0][reference]["losses"], atol=1e-5, rtol=1e-5
        )
    if name.startswith("flatshard_accumulate"):
        assert ckpt["global_step"] == STEPS // 2
    if name == "flatshard_frozen":  # frozen weights did not move and have no optimizer state
        initial = LitGPT().state_dict()
        for key in FrozenGPT.FROZEN:
            torch.testing.assert_close(ckpt["state_dict"][key], initial[key], atol=0, rtol=0)
        n_trainable = sum(1 for n, _ in LitGPT().named_parameters() if n not in FrozenGPT.FROZEN)
        assert sorted(ckpt["optimizer_states"][0]["state"]) == list(range(n_trainable))
    if name.startswith("flatshard_checkpoint"):  # every block recomputed its activations; keys unchanged
        assert all(r[name]["checkpointed"] == N_BLOCKS for r in two_ranks["ranks"])
        assert sorted(ckpt["state_dict"]) == sorted(ddp["state_dict"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["flatshard_block_unused", "flatshard_unused"])
def test_parameters_unused_in_a_step_are_not_updated(name: str, two_ranks: dict[str, Any]) -> None:
    """A block that takes no part in the loss: in plain PyTorch (and DDP) its parameters' ``.grad`` stays None,
    so AdamW skips them (no weight decay, no state). Its own unit never runs (``flatshard_block_unused``); in
    one unit with used parameters (``flatshard_unused``) flatshard must not hand them a zero gradient either."""
    ckpt, ddp = two_ranks["ckpt"][name], two_ranks["ckpt"]["ddp_unused"]
    last = f"model.blocks.{N_BLOCKS - 1}."
    initial = LitGPT().state_dict()
    unused_keys = [k for k in initial if k.startswith(last)]
    assert unused_keys
    for key in unused_keys:  # DDP leaves them as initialised; so must flatshard
        torch.testing.assert_close(ddp["state_dict"][key], initial[key], atol=0, rtol=0)
        torch.testing.assert_close(
            ckpt["state_dict"][key],
            initial[key],
            atol=0,
            rtol=0,
            msg=lambda m, key=key: f"{name}: {key} moved: {m}",
        )
    assert sorted(ckpt["optimizer_states"][0]["state"]) == sorted(ddp["optimizer_states"][0]["state"]), (
        f"{name}: optimizer state was created for parameters that got no gradient"
    )
    assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs ddp")
    assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs ddp")
