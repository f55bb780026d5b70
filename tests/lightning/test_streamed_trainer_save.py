"""The Trainer's full saves (``trainer.save_checkpoint``, ``ModelCheckpoint``) are written as they are gathered
(see [Note: streamed Trainer saves]): the file is the whole consolidated state and resumes, rank 0 holds about a
unit of gathered state at a time, and an ``on_save_checkpoint`` hook that may read the state gets the whole dict
as before, unless it says it leaves the state alone."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import flatshard
import flatshard.lightning.strategy as strategy_module
from flatshard.testing import spawn

from .lit_common import assert_same_optimizer_state, assert_same_weights, make_trainer

pytestmark = pytest.mark.slow

WIDTH, DEPTH, STEPS, PER_RANK = 1024, 8, 4, 4


class Stack(L.LightningModule):
    """Linear layers, each a unit: 4 MiB of weights per unit, 12 MiB with AdamW's two states."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.norm(self.layers(batch[0])).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class DropsNorm(Stack):
    """Its on_save_checkpoint removes keys from the state: it needs the whole dict."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key in [k for k in checkpoint["state_dict"] if k.startswith("norm.")]:
            del checkpoint["state_dict"][key]


class AddsNote(Callback):
    """Adds an entry and leaves the state alone, and says so."""

    flatshard_stream_safe = True

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["note"] = "kept"


def _loader(world: int) -> DataLoader:
    data = torch.randn(STEPS * PER_RANK * world, WIDTH, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(data), batch_size=PER_RANK)


def _hwm_and_rss_mib() -> tuple[float, float]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["VmHWM"].split()[0]) / 1024, int(status["VmRSS"].split()[0]) / 1024


def _run(rank: int, world: int, folder: str, mode: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    streamed: list[str] = []
    original = strategy_module.save_full_streamed

    def counting(path: Any, checkpoint: Any) -> Any:
        streamed.append(os.path.basename(str(path)))
        return original(path, checkpoint)

    strategy_module.save_full_streamed = counting
    model = DropsNorm() if mode == "hook" else Stack()
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)]
    if mode == "safe_callback":
        callbacks.append(AddsNote())
    strategy = flatshard.FlatShardStrategy(auto_wrap_policy={nn.Linear})  # a unit per layer
    trainer = make_trainer(world, strategy, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=True)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flatshard").addHandler(handler)
    logging.getLogger("flatshard").setLevel(logging.INFO)
    trainer.fit(model, _loader(world))
    with open("/proc/self/clear_refs", "w") as f:  # the peak of the save alone
        f.write("5")
    _, before = _hwm_and_rss_mib()
    trainer.save_checkpoint(Path(folder) / "final.ckpt")
    extra = _hwm_and_rss_mib()[0] - before
    state, optim = flatshard.get_state_dict(model, trainer.optimizers[0])
    return {
        "streamed": streamed,
        "extra_mib": extra,
        "state": state,
        "optim": optim,
        "logged": [r for r in records if "not streamed" in r or "gathered whole" in r],
    }


@pytest.mark.timeout(300)
def test_trainer_and_model_checkpoint_saves_stream_and_hold_the_whole_state(tmp_path: Path) -> None:
    ranks = spawn(_run, 2, str(tmp_path), "plain")
    writer = ranks[0]
    assert sorted(writer["streamed"]) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "final.ckpt"]
    assert writer["logged"] == []
    ckpt = torch.load(tmp_path / "final.ckpt", weights_only=True)  # plain tensors and containers only
    assert ckpt["global_step"] == STEPS and "loops" in ckpt and "callbacks" in ckpt
    assert_same_weights(ckpt["state_dict"], writer["state"], "streamed Trainer save")
    assert_same_optimizer_state(ckpt["optimizer_states"][0], writer["optim"], "streamed Trainer save")
    step2 = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
    assert step2["global_step"] == 2 and sorted(step2["state_dict"]) == sorted(ckpt["state_dict"])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left
    # Rank 0 held about one unit of gathered state at a time, far below the whole state (weights and AdamW).
    whole = sum(v.numel() * v.element_size() for v in ckpt["state_dict"].values()) * 3 / 2**20
    assert writer["extra_mib"] < 0.4 * whole, (writer["extra_mib"], whole)


@pytest.mark.timeout(300)
def test_a_hook_that_may_read_the_state_gets_the_whole_dict(tmp_path: Path) -> None:
    writer = spawn(_run, 2, str(tmp_path), "hook")[0]
    assert writer["streamed"] == []
    assert len(writer["logged"]) == 1 and "DropsNorm.on_save_checkpoint" in writer["logged"][0]
    ckpt = torch.load(tmp_path / "final.ckpt", weights_only=True)
    assert ckpt["state_dict"] and not [k for k in ckpt["state_dict"] if k.startswith("norm.")]
    # The whole dict was in rank 0's memory at once (what streaming avoids; the measure sees it).
    whole = sum(v.numel() * v.element_size() for v in ckpt["state_dict"].values()) * 3 / 2**20
    assert writer["extra_mib"] > 0.8 * whole, (writer["extra_mib"], whole)


@pytest.mark.timeout(300)
def test_a_hook_marked_stream_safe_keeps_the_save_streamed(tmp_path: Path) -> None:
    writer = spawn(_run, 2, str(tmp_path), "safe_callback")[0]
    assert "final.ckpt" in writer["streamed"] and writer["logged"] == []
    ckpt = torch.load(tmp_path / "final.ckpt", weights_only=True)
    assert ckpt["note"] == "kept"
    assert_same_weights(ckpt["state_dict"], writer["state"], "streamed save with a stream-safe hook")
