"""Uneven evaluation through the Trainer: a hand-made split gives rank 0 three validation (test, predict)
batches and rank 1 one. Under DDP that completes (its forward has no collectives); under flatshard every loop
completes too (the rank that finishes first serves the other's all-gathers), in fit's validation, validate,
test and predict, and every logged value and prediction equals DDP's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from flatshard.testing import spawn
from flatshard.testing.models import make_batch

from .lit_common import LitGPT, make_loader, make_trainer

pytestmark = pytest.mark.slow

BATCHES = (3, 1)  # evaluation batches of rank 0 and rank 1


class LitEval(LitGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, target = batch
        loss = F.cross_entropy(self.model(idx).flatten(0, 1), target.flatten())
        self.log("val_loss", loss, sync_dist=True, on_epoch=True)
        self.log("val_batches", torch.tensor(1.0), sync_dist=True, reduce_fx="sum", on_epoch=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        idx, target = batch
        loss = F.cross_entropy(self.model(idx).flatten(0, 1), target.flatten())
        self.log("test_loss", loss, sync_dist=True, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)


def _uneven_loader(rank: int) -> DataLoader:
    pairs = [make_batch(100 + 10 * rank + i, 2) for i in range(BATCHES[rank])]
    idx = torch.cat([p[0] for p in pairs])
    target = torch.cat([p[1] for p in pairs])
    return DataLoader(TensorDataset(idx, target), batch_size=2)


def _run(rank: int, world: int, strategy: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = LitEval()
    trainer = make_trainer(
        world,
        strategy,
        max_steps=2,
        use_distributed_sampler=False,
        num_sanity_val_steps=2,
        val_check_interval=1,
        check_val_every_n_epoch=None,
    )
    out: dict[str, Any] = {}
    # fit: both ranks train on the same global batches (rank slices), validation is uneven
    train = make_loader(2, 4, world)
    train = DataLoader(
        train.dataset, batch_size=2, sampler=torch.utils.data.DistributedSampler(train.dataset, world, rank)
    )
    trainer.fit(module, train, val_dataloaders=_uneven_loader(rank))
    out["fit"] = {k: round(float(v), 6) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    out["validate"] = trainer.validate(module, _uneven_loader(rank), verbose=False)
    out["test"] = trainer.test(module, _uneven_loader(rank), verbose=False)
    predictions = trainer.predict(module, _uneven_loader(rank))
    out["predict"] = [p.tolist() for p in predictions or []]
    return out


@pytest.mark.timeout(600)
def test_uneven_evaluation_completes_and_matches_ddp() -> None:
    ours = spawn(_run, 2, "flatshard")
    ddp = spawn(_run, 2, "ddp")
    for rank in range(2):
        for key in ("fit", "validate", "test"):
            assert _rounded(ours[rank][key]) == _rounded(ddp[rank][key]), (
                rank,
                key,
                ours[rank][key],
                ddp[rank][key],
            )
        assert ours[rank]["predict"] == ddp[rank]["predict"], rank
    assert ours[0]["validate"][0]["val_batches"] == sum(BATCHES)


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: round(float(v), 5) for k, v in value.items()}
    return [_rounded(v) for v in value]
