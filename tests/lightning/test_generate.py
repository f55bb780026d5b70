"""``model.generate()`` under the Trainer and Fabric strategies: registered automatically on the submodules
that define it, so it works in callback hooks, inside steps, after ``fit`` and in a Fabric loop, on all ranks;
inside ``unshard_params`` on every rank or on rank 0 alone. Each gives what the same model trained under DDP
generates."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import TinyGPT, make_batch

from .lit_common import LitGPT, make_loader, make_trainer

pytestmark = pytest.mark.slow

NEW_TOKENS = 5


def _prompt() -> torch.Tensor:
    return make_batch(7, 2)[0][:, :3]


class LitGenerating(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[str, torch.Tensor] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.samples["validation_step"] = self.model.generate(_prompt(), NEW_TOKENS)


class Sampler(Callback):
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.samples["on_validation_epoch_end"] = pl_module.model.generate(_prompt(), NEW_TOKENS)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.samples["on_train_end"] = pl_module.model.generate(_prompt(), NEW_TOKENS)


def _fit(rank: int, world: int, strategy: str) -> dict[str, list[list[int]]]:
    torch.set_num_threads(1)
    module = LitGenerating()
    trainer = make_trainer(world, strategy, callbacks=[Sampler()], max_steps=2, limit_val_batches=1)
    loader = make_loader(2, 4, world)
    trainer.fit(module, loader, val_dataloaders=make_loader(1, 4, world))
    module.samples["after_fit"] = module.model.generate(_prompt(), NEW_TOKENS)
    sharded = strategy != "ddp"
    with flatshard.unshard_params(module, writeback=False) if sharded else nullcontext():
        module.samples["unshard_params"] = module.model.generate(_prompt(), NEW_TOKENS)
    with flatshard.unshard_params(module, rank0_only=True, writeback=False) if sharded else nullcontext():
        if rank == 0:
            module.samples["rank0_only"] = module.model.generate(_prompt(), NEW_TOKENS)
    return {k: v.tolist() for k, v in module.samples.items()}


def test_generate_in_hooks_steps_and_after_fit_matches_ddp() -> None:
    ours = spawn(_fit, 2, "flatshard")
    ddp = spawn(_fit, 2, "ddp")
    assert set(ours[0]) == {
        "validation_step",
        "on_validation_epoch_end",
        "on_train_end",
        "after_fit",
        "unshard_params",
        "rank0_only",
    }
    for rank in range(2):
        assert ours[rank] == ddp[rank], (rank, ours[rank], ddp[rank])


class _Wrapper(torch.nn.Module):
    """The language model is an attribute of the module Fabric sets up (its embeddings belong to the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyGPT()

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(idx).flatten(0, 1), target.flatten())


def _fabric(rank: int, world: int, strategy: str) -> list[list[int]]:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = _Wrapper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    per = 4 // world
    for step in range(2):
        idx, tgt = make_batch(step, 4)
        fabric.backward(model(idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]))
        optimizer.step()
        optimizer.zero_grad()
    return model.lm.generate(_prompt(), NEW_TOKENS).tolist()


def test_generate_in_a_fabric_loop_matches_ddp() -> None:
    assert spawn(_fabric, 2, "flatshard") == spawn(_fabric, 2, "ddp")
