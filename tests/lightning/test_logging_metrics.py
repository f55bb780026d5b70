"""Logging and metrics under flatshard on 2 ranks; ``trainer.validate`` and ``trainer.predict`` after ``fit``.

- ``self.log(..., sync_dist=True)`` reduces over ranks (mean by default, sum with ``reduce_fx="sum"``); without
  ``sync_dist`` each rank keeps its own value.
- torchmetrics objects inside the LightningModule are left alone by the sharding (their states are not
  flatshard parameters and keep their shapes) and compute global values: compared with the same metrics
  computed in one process over the whole validation set with the trained weights.
- ``predict`` returns the full model's outputs, each sample exactly once across the ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from flatshard.engine import unit_states
from flatshard.engine.handle import handle_of_param
from flatshard.testing import spawn
from flatshard.testing.models import TinyGPT

from .lit_common import LitGPT, load_ckpt, make_dataset, make_loader, make_trainer, strip_prefix

pytestmark = pytest.mark.slow

VOCAB = 37
TRAIN_STEPS = 3
VAL_SAMPLES = 16  # 2 ranks x batch 4 x 2 batches: no DistributedSampler padding
PREDICT_SAMPLES = 10  # 2 ranks x 5 samples, batch 2: the last batch of each rank is short


class LitMetrics(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.val_loss = MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.val_acc_per_class = MulticlassAccuracy(num_classes=VOCAB, average=None)
        self.val_rank = MeanMetric()
        self.per_class: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        value = torch.tensor(float(self.global_rank + 1) * (batch_idx + 1))
        self.log("rank_mean", value, sync_dist=True)
        self.log("rank_sum", value, sync_dist=True, reduce_fx="sum")
        self.log("rank_local", value)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, target = batch
        logits = self.model(idx)
        per_sample = F.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(dim=1)
        self.val_loss.update(per_sample)
        self.val_acc.update(logits.argmax(-1), target)
        self.val_acc_per_class.update(logits.argmax(-1), target)
        self.val_rank.update(torch.full((idx.shape[0],), float(self.global_rank)))
        self.log("val_loss", self.val_loss)
        self.log("val_acc", self.val_acc)
        self.log("val_rank", self.val_rank)

    def on_validation_epoch_end(self) -> None:
        self.per_class = self.val_acc_per_class.compute()
        self.val_acc_per_class.reset()

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        idx, _, ids = batch
        return {"ids": ids, "logits": self.model(idx)}


def _metric_tensors(model: LitMetrics) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name in ("val_loss", "val_acc", "val_acc_per_class", "val_rank"):
        for state, value in getattr(model, name).metric_state.items():
            out[f"{name}.{state}"] = value if isinstance(value, list) else [value]
    return out


def _val_loader() -> DataLoader:
    return DataLoader(
        make_dataset(1, VAL_SAMPLES, first_step=100), batch_size=VAL_SAMPLES // 4, shuffle=False
    )


def _predict_loader() -> DataLoader:
    data = make_dataset(1, PREDICT_SAMPLES, first_step=200)
    return DataLoader(
        TensorDataset(*data.tensors, torch.arange(PREDICT_SAMPLES)), batch_size=2, shuffle=False
    )


def _run(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    model = LitMetrics()
    trainer = make_trainer(world, "flatshard", max_epochs=1)
    trainer.fit(model, make_loader(TRAIN_STEPS, 2 * world, world), _val_loader())
    train_metrics = {k: float(trainer.callback_metrics[k]) for k in ("rank_mean", "rank_sum", "rank_local")}
    fit_val = {k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_acc", "val_rank")}
    trainer.save_checkpoint(os.path.join(out_dir, "trained.ckpt"))

    managed = {id(p) for s in unit_states(model) for h in s.handles for p in h.params}
    metric_tensors = _metric_tensors(model)
    validated = trainer.validate(model, _val_loader(), verbose=False)
    assert model.per_class is not None
    predictions = trainer.predict(model, _predict_loader())
    return {
        "train": train_metrics,
        "fit_val": fit_val,
        "validate": {k: float(v) for k, v in validated[0].items()},
        "per_class": model.per_class.clone(),
        "managed_are_tinygpt": managed == {id(p) for p in model.model.parameters()},
        "metric_states_managed": [
            k for k, ts in metric_tensors.items() if any(handle_of_param(t) is not None for t in ts)
        ],
        "metric_state_shapes": {k: [tuple(t.shape) for t in ts] for k, ts in metric_tensors.items()},
        "metric_params": [n for n, _ in model.named_parameters() if not n.startswith("model.")],
        "predictions": [{k: v.clone() for k, v in batch.items()} for batch in predictions],
        "strategy": type(trainer.strategy).__name__,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("metrics")
    ranks = spawn(_run, 2, str(directory))
    return {"ranks": ranks, "ckpt": load_ckpt(directory / "trained.ckpt")}


@pytest.fixture(scope="module")
def reference(runs: dict[str, Any]) -> dict[str, Any]:
    """The same metrics, in one process, over the whole validation set, with the trained weights."""
    model = TinyGPT()
    model.load_state_dict(strip_prefix(runs["ckpt"]["state_dict"]))
    idx, target = make_dataset(1, VAL_SAMPLES, first_step=100).tensors
    with torch.no_grad():
        logits = model(idx)
    per_class = MulticlassAccuracy(num_classes=VOCAB, average=None)
    per_class.update(logits.argmax(-1), target)
    pidx, _ = make_dataset(1, PREDICT_SAMPLES, first_step=200).tensors
    with torch.no_grad():
        predict_logits = model(pidx)
    return {
        "val_loss": F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        .mean(dim=1)
        .mean()
        .item(),
        "val_acc": (logits.argmax(-1) == target).float().mean().item(),
        "per_class": per_class.compute(),
        "per_class_shapes": {k: tuple(v.shape) for k, v in per_class.metric_state.items()},
        "predict_logits": predict_logits,
    }


@pytest.mark.timeout(300)
def test_sync_dist_reduces_over_ranks(runs: dict[str, Any]) -> None:
    last = TRAIN_STEPS  # the value logged at the last step is (rank + 1) * TRAIN_STEPS
    for rank, info in enumerate(runs["ranks"]):
        assert info["strategy"] == "FlatShardStrategy"
        assert info["train"]["rank_mean"] == pytest.approx(1.5 * last)
        assert info["train"]["rank_sum"] == pytest.approx(3.0 * last)
        assert info["train"]["rank_local"] == pytest.approx((rank + 1) * last)


@pytest.mark.timeout(300)
def test_metrics_are_not_sharded(runs: dict[str, Any], reference: dict[str, Any]) -> None:
    for info in runs["ranks"]:
        assert info["managed_are_tinygpt"], "flatshard manages exactly the TinyGPT parameters"
        assert info["metric_params"] == []
        assert info["metric_states_managed"] == []
        shapes = info["metric_state_shapes"]
        # The per-class accuracy keeps one counter per class (a sharded state would be a 1-D piece).
        for state, shape in reference["per_class_shapes"].items():
            assert shapes[f"val_acc_per_class.{state}"] == [shape], (state, shapes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["fit_val", "validate"])
def test_metrics_compute_global_values(source: str, runs: dict[str, Any], reference: dict[str, Any]) -> None:
    for info in runs["ranks"]:
        values = info[source]
        assert values["val_rank"] == pytest.approx(0.5), "MeanMetric of the rank: both ranks count equally"
        if source == "validate":  # fit's validation ran with the same final weights (end of the only epoch)
            assert sorted(values) == ["val_acc", "val_loss", "val_rank"]
        assert values["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
        assert values["val_acc"] == pytest.approx(reference["val_acc"], abs=1e-6)
        torch.testing.assert_close(info["per_class"], reference["per_class"], atol=1e-6, rtol=0)


@pytest.mark.timeout(300)
def test_predict_after_fit_returns_full_model_outputs(
    runs: dict[str, Any], reference: dict[str, Any]
) -> None:
    ids = torch.cat([b["ids"] for info in runs["ranks"] for b in info["predictions"]])
    logits = torch.cat([b["logits"] for info in runs["ranks"] for b in info["predictions"]])
    assert sorted(ids.tolist()) == list(range(PREDICT_SAMPLES)), "every sample predicted exactly once"
    assert logits.shape == (PREDICT_SAMPLES, 7, VOCAB)
    torch.testing.assert_close(logits, reference["predict_logits"][ids], atol=1e-5, rtol=1e-5)
