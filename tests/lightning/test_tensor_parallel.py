"""Tensor parallelism through the Trainer: ``FlatShardStrategy(tensor_parallel_size=k)`` on 4 CPU ranks.

The LightningModule applies torch's Llama plan in ``configure_model`` on ``self.device_mesh["tensor_parallel"]``
(sequence parallelism included) and flatshard shards the local tensors over "data_parallel". Compared with one
device (``strategy="auto"``) on the same global batches: losses, the checkpoint's weights (plain tensors of the
original shapes) and AdamW state; sharded checkpoints resume on other mesh shapes and are exchanged with
Lightning's ``ModelParallelStrategy`` (FSDP2 + TP) both ways (see [Note: tensor parallelism]).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import flatshard
from flatshard.testing import spawn
from tests.tp_models import VOCAB, Block, TPLlama, llama_loss, llama_plan

from .lit_common import LossRecorder, load_ckpt, make_trainer

GLOBAL_BATCH, STEPS_PER_EPOCH = 8, 3
TOL = 3e-4  # Adam amplifies fp32 rounding of the tensor-parallel sums where gradients are tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class LitTP(L.LightningModule):
    def __init__(self, seed: int = 0, fsdp2: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = TPLlama()
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:  # the one-device reference
            return
        llama_plan(self.model, mesh["tensor_parallel"])
        if self.fsdp2:  # as Lightning's ModelParallelStrategy expects
            from torch.distributed.fsdp import fully_shard

            for block in self.model.layers:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = llama_loss(self.model, batch[0])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(data_parallel: int) -> DataLoader:
    """Per data-parallel rank (Lightning adds its sampler); for 1 the reference's loader over the same
    permutation (see tests/lightning/lit_common.py)."""
    tokens = torch.randint(
        0, VOCAB, (STEPS_PER_EPOCH * GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(5)
    )
    dataset = TensorDataset(tokens)
    if data_parallel > 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // data_parallel, shuffle=False)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler)


def _fit(
    world: int, strategy: Any, dp: int, epochs: int, out: str, ckpt: str | None = None, **lit: Any
) -> Any:
    recorder = LossRecorder()
    trainer = make_trainer(world, strategy, max_epochs=epochs, callbacks=[recorder])
    trainer.fit(LitTP(**lit), _loader(dp), ckpt_path=ckpt)
    trainer.save_checkpoint(out)
    return recorder.losses


def _flatshard(tp: int, kind: str = "full") -> Any:
    return flatshard.FlatShardStrategy(
        tensor_parallel_size=tp, auto_wrap_policy={Block}, state_dict_type=kind
    )


def _reference(epochs: int) -> tuple[list[float], dict[str, Any]]:
    recorder = LossRecorder()
    model = LitTP()
    trainer = make_trainer(1, "auto", max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, _loader(1))
    return recorder.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _first_epoch(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "full": _fit(world, _flatshard(2), 2, 1, os.path.join(tmp, "full.ckpt")),
        "sharded": _fit(world, _flatshard(2, "sharded"), 2, 1, os.path.join(tmp, "sharded")),
    }


def _second_epoch(rank: int, world: int, tmp: str, tp: int, source: str) -> list[float]:
    torch.set_num_threads(1)
    return _fit(
        world, _flatshard(tp), world // tp, 2, os.path.join(tmp, f"resumed_{tp}.ckpt"), source, seed=9
    )


def _close(actual: list[float], expected: list[float]) -> None:
    assert actual == pytest.approx(expected, abs=TOL), (actual, expected)


def _same_weights(path: Any, expected: dict[str, Any]) -> None:
    state = load_ckpt(path)["state_dict"]
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert type(state[key]) is torch.Tensor and state[key].shape == value.shape, key
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=TOL, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_tensor_parallel_matches_one_device_and_resumes_on_other_shapes(tmp_path: Any) -> None:
    first = spawn(_first_epoch, 4, str(tmp_path))[0]
    losses, weights = _reference(1)
    _close(first["full"], losses)
    _close(first["sharded"], losses)
    _same_weights(tmp_path / "full.ckpt", weights)
    plain = load_ckpt(tmp_path / "full.ckpt")
    assert (
        plain["optimizer_states"][0]["state"][0]["exp_avg"].shape
        == weights["model.tok_embeddings.weight"].shape
    )

    all_losses, final = _reference(2)
    for tp, source in ((4, "sharded"), (1, "full.ckpt")):  # 2 x 2 -> 1 x 4 (sharded), 2 x 2 -> 4 x 1 (full)
        second = spawn(_second_epoch, 4, str(tmp_path), tp, str(tmp_path / source))[0]
        _close(second, all_losses[STEPS_PER_EPOCH:])
        _same_weights(tmp_path / f"resumed_{tp}.ckpt", final)


def _model_parallel_then_flatshard(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    theirs = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    first = _fit(world, theirs, 2, 1, os.path.join(tmp, "theirs"), fsdp2=True)
    second = _fit(
        world, _flatshard(2, "sharded"), 2, 2, os.path.join(tmp, "ours"), os.path.join(tmp, "theirs"), seed=9
    )
    return {"first": first, "second": second}


def _flatshard_then_model_parallel(rank: int, world: int, tmp: str) -> list[float]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    theirs = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=4)
    return _fit(
        world, theirs, 1, 3, os.path.join(tmp, "theirs_again"), os.path.join(tmp, "ours"), seed=9, fsdp2=True
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_checkpoints_are_exchanged_with_model_parallel_strategy(tmp_path: Any) -> None:
    """ModelParallelStrategy (FSDP2 + TP, 2 x 2) trains epoch 1; flatshard (2 x 2) resumes its directory for epoch
    2 and saves its own; ModelParallelStrategy (1 x 4) resumes that for epoch 3."""
    out = spawn(_model_parallel_then_flatshard, 4, str(tmp_path))[0]
    losses, _ = _reference(3)
    _close(out["first"], losses[:STEPS_PER_EPOCH])
    _close(out["second"], losses[STEPS_PER_EPOCH : 2 * STEPS_PER_EPOCH])
    third = spawn(_flatshard_then_model_parallel, 4, str(tmp_path))[0]
    _close(third, losses[2 * STEPS_PER_EPOCH :])
