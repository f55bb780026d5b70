"""Float8 training (torchao ``Float8Linear``, float8 all-gathers) through the Trainer on 2 CPU ranks: the same
losses and weights as DDP training the same torchao model, eager and compiled; the checkpoint holds fp32
weights that load into the model without float8, and a sharded checkpoint resumes (see [Note: float8
all-gathers])."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import flatshard
from flatshard.testing import spawn

from .lit_common import LossRecorder, make_trainer, strip_prefix

pytest.importorskip("torchao.float8")

STEPS = 3
GLOBAL_BATCH = 16


class LitFloat8(L.LightningModule):
    def __init__(self, all_gather: bool = True) -> None:
        super().__init__()
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from tests.distributed.test_float8 import Net

        torch.manual_seed(0)
        self.model = Net()
        convert_to_float8_training(
            self.model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch[0]).square().mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(world: int, first: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn((first + STEPS) * GLOBAL_BATCH, 32, generator=g)[first * GLOBAL_BATCH :]
    return DataLoader(TensorDataset(x), batch_size=GLOBAL_BATCH // world, shuffle=False)


def _strategy(name: str, **kwargs: Any) -> Any:
    if name == "ddp":
        return "ddp"
    from tests.distributed.test_float8 import Block

    return flatshard.FlatShardStrategy(auto_wrap_policy={Block}, **kwargs)


def _fit(world: int, name: str, out: str, **kwargs: Any) -> dict[str, Any]:
    recorder = LossRecorder()
    module = LitFloat8()
    trainer = make_trainer(world, _strategy(name, **kwargs), max_epochs=1, callbacks=[recorder])
    trainer.fit(module, _loader(world))
    trainer.save_checkpoint(out)
    return {"losses": recorder.losses}


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, kwargs in (
        ("ddp", {}),
        ("flatshard", {}),
        ("compiled", {"compile": {"backend": "aot_eager"}}),
        ("sharded", {"state_dict_type": "sharded"}),
    ):
        out[name] = _fit(world, "ddp" if name == "ddp" else "flatshard", os.path.join(tmp, name), **kwargs)
    return out


@pytest.mark.timeout(600)
def test_trainer_float8_matches_ddp_and_checkpoints_load_without_float8(tmp_path: Any) -> None:
    results = spawn(_run, 2, str(tmp_path))
    reference = results[0]["ddp"]["losses"]
    assert len(reference) == STEPS
    for name in ("flatshard", "compiled", "sharded"):
        assert results[0][name]["losses"] == pytest.approx(reference, abs=1e-6), name

    from tests.distributed.test_float8 import Net

    ddp = strip_prefix(torch.load(tmp_path / "ddp", weights_only=True)["state_dict"])
    ours = strip_prefix(torch.load(tmp_path / "flatshard", weights_only=True)["state_dict"])
    assert sorted(ours) == sorted(ddp)
    for k, v in ddp.items():
        assert type(ours[k]) is torch.Tensor and ours[k].dtype == torch.float32, k
        torch.testing.assert_close(ours[k], v.as_subclass(torch.Tensor), atol=1e-6, rtol=0)
    plain = Net()  # no float8: the fp32 weights load as they are
    plain.load_state_dict(ours)

    # the sharded checkpoint consolidates to the same weights
    consolidated = tmp_path / "consolidated.ckpt"
    flatshard.checkpoint.consolidate(str(tmp_path / "sharded"), str(consolidated))
    merged = strip_prefix(torch.load(consolidated, weights_only=True)["state_dict"])
    for k, v in ours.items():
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=0)


def _resume(rank: int, world: int, tmp: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    out = {}
    for name, strategy, ckpt in (
        ("ddp", "ddp", "ddp_plain"),  # the same (distributed) sampler as flatshard's
        ("flatshard", _strategy("flatshard", state_dict_type="sharded"), "sharded"),
    ):
        recorder = LossRecorder()
        trainer = make_trainer(world, strategy, max_epochs=2, callbacks=[recorder])
        trainer.fit(LitFloat8(), _loader(world), ckpt_path=os.path.join(tmp, ckpt))
        out[name] = recorder.losses
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_float8_sharded_checkpoint_resumes_on_one_rank(tmp_path: Any) -> None:
    """Saved on 2 ranks, resumed on 1: the second epoch matches the DDP checkpoint resumed the same way."""
    spawn(_run, 2, str(tmp_path))
    # DDP's checkpoint holds torchao's weight subclass, which Lightning's loading cannot map: plain tensors
    ddp = torch.load(tmp_path / "ddp", weights_only=False)
    ddp["state_dict"] = {
        k: v.detach().as_subclass(torch.Tensor).clone() for k, v in ddp["state_dict"].items()
    }
    torch.save(ddp, tmp_path / "ddp_plain")
    resumed = spawn(_resume, 1, str(tmp_path))[0]
    assert len(resumed["ddp"]) == STEPS
    assert resumed["flatshard"] == pytest.approx(resumed["ddp"], abs=1e-6)
