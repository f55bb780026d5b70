"""``FlatShardStrategy(activation_checkpointing_mode=...)`` under the Trainer: selective checkpointing and an operator
list train a model with dropout exactly like the same strategy without checkpointing (losses, gradients, weights,
optimizer state), and the option reaches ``shard()`` (see [Note: selective checkpointing])."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.engine.setup.activation_checkpointing import checkpointed_call
from flatshard.testing import spawn
from tests.dropout_models import DropoutBlock, dropout_gpt

from .lit_common import LossRecorder, make_loader, make_trainer

STEPS = 3

# name -> activation_checkpointing_mode (None: no checkpointing, the reference)
MODES: dict[str, Any] = {"plain": None, "selective": "selective", "ops": ["aten.mm", "aten.addmm"]}


class LitDropoutGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = dropout_gpt()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model.loss(batch[0], batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GradRecorder(Callback):
    """Each step's local gradient shards, before the optimizer uses them."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.grads.append(
            [p.grad.clone() for p in module.parameters() if p.grad is not None and p.grad.numel()]
        )


def _fit(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        mode = MODES[name]
        checkpointing = {} if mode is None else {"activation_checkpointing_policy": {DropoutBlock}}
        strategy = flatshard.FlatShardStrategy(
            auto_wrap_policy={DropoutBlock}, activation_checkpointing_mode=mode or "full", **checkpointing
        )
        module = LitDropoutGPT()
        losses, grads = LossRecorder(), GradRecorder()
        trainer = make_trainer(world, strategy, max_epochs=1, callbacks=[losses, grads])
        torch.manual_seed(100 + rank)  # the same dropout masks in every run
        trainer.fit(module, make_loader(STEPS, 2 * world, world))
        full, optim = flatshard.get_state_dict(module, trainer.optimizers[0], rank0_only=False)
        out[name] = {
            "losses": losses.losses,
            "grads": grads.grads,
            "weights": full,
            "exp_avg_sq": [s["exp_avg_sq"] for s in optim["state"].values()],
            "checkpointed": [
                checkpointed_call(m) for m in module.modules() if checkpointed_call(m) is not None
            ],
            "mode": strategy.options.shard.activation_checkpointing_mode,
        }
        out[name]["contexts"] = sum(c.context_fn is not None for c in out[name].pop("checkpointed"))
    return out


def _check(results: list[dict[str, Any]], names: list[str]) -> None:
    for rank, runs in enumerate(results):
        plain = runs["plain"]
        assert len(plain["losses"]) == len(plain["grads"]) == STEPS
        for name in names:
            run, where = runs[name], f"rank {rank} {name}"
            assert run["contexts"] == 3, where  # every block checkpointed selectively
            assert run["mode"] == ("selective" if name == "selective" else ("aten.mm", "aten.addmm")), where
            torch.testing.assert_close(run["losses"], plain["losses"], rtol=0, atol=1e-6, msg=where)
            for mine, theirs in zip(run["grads"], plain["grads"], strict=True):
                for a, b in zip(mine, theirs, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=where)
            for key, value in plain["weights"].items():
                torch.testing.assert_close(
                    run["weights"][key], value, rtol=1e-5, atol=1e-6, msg=f"{where} {key}"
                )
            for a, b in zip(run["exp_avg_sq"], plain["exp_avg_sq"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9, msg=where)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["selective", pytest.param("ops", marks=pytest.mark.slow)])
def test_trainer_selective_checkpointing_trains_like_no_checkpointing(name: str) -> None:
    _check(spawn(_fit, 2, ["plain", name]), [name])
