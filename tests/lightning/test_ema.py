"""``flatshard.lightning.ShardedEMA``: the EMA of the weights, kept per shard, equals a plain EMA of the
single-device run's weights (same global batch) to 1e-5; full files carry it consolidated under the model's
names, sharded directories as each rank's pieces (no gather), and a run resumed on another number of ranks goes
on from either.

Global batch 6 (2 ranks x 3, 3 ranks x 2, 1 device x 6), 3 steps per epoch: 2 ranks train epoch 1 and save,
3 ranks resume for epoch 2; the reference trains both epochs on one device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.checkpoint import ShardedReader
from flatshard.checkpoint.dcp_layout import StoredPiece
from flatshard.checkpoint.export import export_safetensors, load_safetensors
from flatshard.lightning import ShardedEMA
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, load_ckpt, make_loader, make_trainer

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS, DECAY = 6, 3, 0.8
TOL = {"atol": 1e-5, "rtol": 1e-5}


class PlainEMA(Callback):
    """The reference: an EMA of the full weights after every optimizer step, by the formula."""

    def __init__(self) -> None:
        self.ema: dict[str, torch.Tensor] = {}
        self.snapshots: list[dict[str, torch.Tensor]] = []  # at the end of each epoch

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, p in pl_module.named_parameters():
            old = self.ema.get(name)
            self.ema[name] = p.detach().clone() if old is None else DECAY * old + (1 - DECAY) * p.detach()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ema = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.snapshots.append({n: v.clone() for n, v in self.ema.items()})


def _ema_state_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    states = [v for k, v in checkpoint["callbacks"].items() if k.startswith("ShardedEMA")]
    assert len(states) == 1, sorted(checkpoint["callbacks"])
    return states[0]


class LitEval(LitGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model.loss(batch[0], batch[1]), sync_dist=True)


def _strategy(state_dict_type: str) -> flatshard.FlatShardStrategy:
    return flatshard.FlatShardStrategy(state_dict_type=state_dict_type, auto_wrap_policy={Block})


def _first(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    results = {}
    for kind in ("sharded", "full"):
        ema = ShardedEMA(decay=DECAY)
        trainer = make_trainer(world, _strategy(kind), max_epochs=1, callbacks=[ema])
        trainer.fit(LitGPT(), make_loader(STEPS, GLOBAL_BATCH, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{kind}.ckpt"))
        assert ema.ema is not None
        results[kind] = ema.ema.full_state_dict()  # rank 0: consolidated; elsewhere empty
    return results


def _resume(rank: int, world: int, out_dir: str, kind: str) -> dict[str, Any]:
    ema = ShardedEMA(decay=DECAY)
    trainer = make_trainer(world, _strategy(kind), max_epochs=2, callbacks=[ema])
    model = LitEval()
    trainer.fit(
        model, make_loader(STEPS, GLOBAL_BATCH, world), ckpt_path=os.path.join(out_dir, f"{kind}.ckpt")
    )
    assert ema.ema is not None and not ema.ema.swapped
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.validate(model, make_loader(1, GLOBAL_BATCH, world), verbose=False)  # swaps the EMA in and out
    restored = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    return {"ema": ema.ema.full_state_dict(), "updates": ema.ema.num_updates, "restored": restored}


@pytest.mark.timeout(600)
def test_sharded_ema_equals_the_plain_ema_and_resumes_on_another_world_size(tmp_path: Path) -> None:
    reference = PlainEMA()
    trainer = make_trainer(1, "auto", max_epochs=2, callbacks=[reference])
    trainer.fit(LitGPT(), make_loader(STEPS, GLOBAL_BATCH, 1))
    after_first, after_second = reference.snapshots

    first = spawn(_first, 2, str(tmp_path))[0]
    for kind in ("sharded", "full"):
        for name, value in after_first.items():
            torch.testing.assert_close(
                first[kind][name], value, **TOL, msg=lambda m, n=name, k=kind: f"{k}: {n}: {m}"
            )
    # the full file holds the consolidated EMA under the model's names, loadable into the plain model
    state = _ema_state_of(load_ckpt(tmp_path / "full.ckpt"))
    assert state["num_updates"] == STEPS
    plain = LitGPT()
    plain.load_state_dict(state["ema_state_dict"], strict=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), after_first[name], **TOL)
    # the sharded directory stores the EMA as pieces under the parameters' full shapes, not one gathered object
    reader = ShardedReader(tmp_path / "sharded.ckpt")
    stored = _ema_state_of(reader.read_extra())["ema_state_dict"]
    assert isinstance(stored["model.wte.weight"], StoredPiece) and stored["model.wte.weight"].shape == (
        37,
        13,
    )
    assert stored["model.head.weight"] == stored["model.wte.weight"]  # tied: stored once
    assert reader.full_shape(stored["model.wte.weight"].fqn) == (37, 13)
    consolidated = load_ckpt(flatshard.consolidate(tmp_path / "sharded.ckpt", tmp_path / "consolidated.ckpt"))
    plain = LitGPT()
    plain.load_state_dict(_ema_state_of(consolidated)["ema_state_dict"], strict=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), after_first[name], **TOL)
    for kind in ("sharded", "full"):  # the export of the EMA, from a directory and from a file
        out = tmp_path / f"ema-{kind}.safetensors"
        export_safetensors(tmp_path / f"{kind}.ckpt", out, prefix="model.", ema=True)
        exported = load_safetensors(out)
        for name, value in after_first.items():
            torch.testing.assert_close(exported[name.removeprefix("model.")], value, **TOL)

    for kind in ("sharded", "full"):  # resumed on 3 ranks: the EMA goes on as if never interrupted
        result = spawn(_resume, 3, str(tmp_path), kind)[0]
        assert result["updates"] == 2 * STEPS and result["restored"], (kind, result["updates"])
        for name, value in after_second.items():
            torch.testing.assert_close(
                result["ema"][name], value, **TOL, msg=lambda m, n=name, k=kind: f"{k}: {n}: {m}"
            )
