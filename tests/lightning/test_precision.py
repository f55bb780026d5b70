"""Trainer precision flags under flatshard against DDP with the same flag, on 2 ranks.

flatshard's ``*-mixed`` computes with gathered low-precision weights (all of them, also norms and
embeddings) where DDP's autocast casts only matmul inputs, so the two agree to bf16/fp16 rounding, not
bitwise; the exact dtype rule is checked against an emulation in ``tests/distributed/test_mixed_precision``.
SGD keeps the comparison linear in the gradients (AdamW would amplify rounding of near-zero gradients).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

import flatshard
from flatshard.lightning.precision import FlatShardGradScaler, FlatShardPrecision
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, LossRecorder, assert_runs_close, load_ckpt, make_loader, make_trainer

STEPS = 4
PER_RANK = 2


class DtypeGPT(LitGPT):
    """Records the dtype of an embedding weight (root unit) and of a block weight as training sees them."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.1)
        self.seen: set[tuple[str, str]] = set()
        self.loss_mean = MeanMetric()  # a metric inside the sharded module: never cast, never sharded

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.add(("wte", str(self.model.wte.weight.dtype)))
        loss = super().training_step(batch, batch_idx)
        self.loss_mean.update(loss.detach().float())
        return loss


def _fp16_mixed() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))


# name -> (strategy factory, Trainer arguments)
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "ddp_bf16_mixed": (lambda: "ddp", {"precision": "bf16-mixed"}),
    "flatshard_bf16_mixed": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        {"precision": "bf16-mixed"},
    ),
    "ddp_bf16_true": (lambda: "ddp", {"precision": "bf16-true"}),
    "flatshard_bf16_true": (lambda: "flatshard", {"precision": "bf16-true"}),
    "ddp_16_mixed": (lambda: "ddp", {"plugins": [_fp16_mixed()], "gradient_clip_val": 0.5}),
    "flatshard_16_mixed": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        {"plugins": [_fp16_mixed()], "gradient_clip_val": 0.5},
    ),
}


def _train_all(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (make_strategy, extra) in CASES.items():
        model = DtypeGPT()
        recorder = LossRecorder()
        trainer = make_trainer(world, make_strategy(), max_epochs=1, callbacks=[recorder], **extra)
        trainer.fit(model, make_loader(STEPS, PER_RANK * world, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{name}.ckpt"))
        results[name] = {
            "losses": recorder.losses,
            "seen": sorted(model.seen),
            "plugin": type(trainer.strategy.precision_plugin).__name__,
            "scaler": type(getattr(trainer.strategy.precision_plugin, "scaler", None)).__name__,
            "metric_dtype": str(model.loss_mean.mean_value.dtype),
            "metric_mean": float(model.loss_mean.compute()),
        }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("precision")
    ranks = spawn(_train_all, 2, str(directory))
    return {"ranks": ranks, "ckpt": {n: load_ckpt(directory / f"{n}.ckpt") for n in CASES}, "dir": directory}


def _close(flatshard_run: str, ddp_run: str, runs: dict[str, Any], tol: float) -> None:
    assert_runs_close(runs, flatshard_run, ddp_run, STEPS, tol)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_mixed_matches_ddp(runs: dict[str, Any]) -> None:
    """bf16 compute inside units, fp32 weights in the checkpoint, close to DDP's autocast training."""
    _close("flatshard_bf16_mixed", "ddp_bf16_mixed", runs, tol=2e-2)
    ours = runs["ranks"][0]["flatshard_bf16_mixed"]
    assert ours["plugin"] == "FlatShardPrecision"
    assert ours["seen"] == [("wte", "torch.bfloat16")]  # the gathered root unit is bf16 ...
    state = runs["ckpt"]["flatshard_bf16_mixed"]["state_dict"]
    assert {v.dtype for k, v in state.items() if v.is_floating_point()} == {
        torch.float32
    }  # ... the shards fp32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_true_matches_ddp(runs: dict[str, Any]) -> None:
    """The model is cast before sharding: no fp32 copy anywhere, checkpoint in bf16 like DDP's."""
    _close("flatshard_bf16_true", "ddp_bf16_true", runs, tol=3e-2)
    assert runs["ranks"][0]["flatshard_bf16_true"]["seen"] == [("wte", "torch.bfloat16")]
    state = runs["ckpt"]["flatshard_bf16_true"]["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_16_mixed_scaler_matches_ddp(runs: dict[str, Any]) -> None:
    """fp16 with loss scaling and norm clipping; the user's scaler settings carry over to the sharded scaler."""
    _close("flatshard_16_mixed", "ddp_16_mixed", runs, tol=2e-2)
    ours = runs["ranks"][0]["flatshard_16_mixed"]
    assert ours["seen"] == [("wte", "torch.float16")]
    assert ours["scaler"] == "FlatShardGradScaler"
    ckpt = runs["ckpt"]["flatshard_16_mixed"]
    assert ckpt["FlatShardPrecision"]["scale"] == runs["ckpt"]["ddp_16_mixed"]["MixedPrecision"]["scale"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_16_mixed_scaler_state_resumes_across_strategies(runs: dict[str, Any]) -> None:
    """flatshard's loss scale resumes under Lightning's own AMP plugin (ddp / auto) and the other way round."""
    saved = runs["ckpt"]["flatshard_16_mixed"]["FlatShardPrecision"]
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**16))
    trainer = make_trainer(1, "auto", max_epochs=2, plugins=[plugin])
    trainer.fit(
        DtypeGPT(), make_loader(STEPS, PER_RANK * 2, 1), ckpt_path=runs["dir"] / "flatshard_16_mixed.ckpt"
    )
    assert plugin.scaler is not None and plugin.scaler.get_scale() == saved["scale"] != 2.0**16
    assert plugin.scaler._get_growth_tracker() == saved["_growth_tracker"] + STEPS  # no overflow in 4 steps

    theirs = runs["ckpt"]["ddp_16_mixed"]
    ours = FlatShardPrecision("16-mixed", device="cpu", scaler=FlatShardGradScaler("cpu", init_scale=2.0**16))
    ours.on_load_checkpoint(theirs)
    assert ours.scaler is not None and ours.scaler.state_dict() == theirs["MixedPrecision"]


class RegressionModule(L.LightningModule):
    """Float inputs and float targets; records the dtypes the steps receive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.seen: set[tuple[str, str, str]] = set()

    def _step(self, stage: str, batch: Any) -> torch.Tensor:
        x, y = batch
        self.seen.update({(stage, "x", str(x.dtype)), (stage, "y", str(y.dtype))})
        return torch.nn.functional.mse_loss(self(x).float(), y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step("val", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _batch_dtypes(rank: int, world: int) -> dict[str, list[tuple[str, str, str]]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), 1000.0 + torch.randn(16, 1, generator=g))
    out = {}
    for name, strategy in (("flatshard", "flatshard"), ("ddp", "ddp")):
        model = RegressionModule()
        trainer = make_trainer(world, strategy, max_steps=2, precision="bf16-mixed", limit_val_batches=1)
        trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
        out[name] = sorted(model.seen)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_batch_keeps_its_dtypes_under_autocast() -> None:
    """Under bf16-mixed the batch reaches training_step and validation_step as it came, as under DDP: targets
    near 1000 cast to bf16 would lose everything below 4. The root unit holds parameters here."""
    for rank in spawn(_batch_dtypes, 2):
        assert rank["flatshard"] == rank["ddp"], rank
        assert {dtype for _, _, dtype in rank["flatshard"]} == {"torch.float32"}, rank


@pytest.mark.slow
def test_metrics_are_never_cast(runs: dict[str, Any]) -> None:
    """torchmetrics state keeps fp32 under every flag (DDP's bf16-true casts it), and its value agrees."""
    for name in CASES:
        if name.startswith("flatshard"):
            assert runs["ranks"][0][name]["metric_dtype"] == "torch.float32", name
    for flag in ("bf16_mixed", "bf16_true", "16_mixed"):
        ours, theirs = runs["ranks"][0][f"flatshard_{flag}"], runs["ranks"][0][f"ddp_{flag}"]
        assert abs(ours["metric_mean"] - theirs["metric_mean"]) <= 3e-2 * abs(theirs["metric_mean"]), flag


def test_precision_plugin_errors() -> None:
    with pytest.raises(ValueError, match="not supported by flatshard"):
        FlatShardPrecision("64-true")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not use a grad scaler"):
        FlatShardPrecision("bf16-mixed", scaler=FlatShardGradScaler("cpu"))
    with pytest.raises(TypeError, match="FlatShardGradScaler"):
        FlatShardPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64-true"):
        make_trainer(1, "flatshard", precision="64-true")
