"""Trainer precision flags under flatshard against DDP with the same flag, on 2 ranks.

flatshard's ``*-mixed`` computes with gathered low-precision weights (all of them, also norms and
embeddings) where DDP's autocast casts only matmul inputs, so the two agree to bf16/fp16 rounding, not
bitwise; the exact dtype rule is checked against an emulation in ``tests/distributed/test_mixed_precision``.
SGD keeps the comparison linear in the gradients (AdamW would amplify rounding of near-zero gradients).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
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
    return {"ranks": ranks, "ckpt": {n: load_ckpt(directory / f"{n}.ckpt") for n in CASES}}


def _close(flatshard_run: str, ddp_run: str, runs: dict[str, Any], tol: float) -> None:
    assert_runs_close(runs, flatshard_run, ddp_run, STEPS, tol)


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


@pytest.mark.timeout(300)
def test_bf16_true_matches_ddp(runs: dict[str, Any]) -> None:
    """The model is cast before sharding: no fp32 copy anywhere, checkpoint in bf16 like DDP's."""
    _close("flatshard_bf16_true", "ddp_bf16_true", runs, tol=3e-2)
    assert runs["ranks"][0]["flatshard_bf16_true"]["seen"] == [("wte", "torch.bfloat16")]
    state = runs["ckpt"]["flatshard_bf16_true"]["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}


@pytest.mark.timeout(300)
def test_16_mixed_scaler_matches_ddp(runs: dict[str, Any]) -> None:
    """fp16 with loss scaling and norm clipping; the user's scaler settings carry over to the sharded scaler."""
    _close("flatshard_16_mixed", "ddp_16_mixed", runs, tol=2e-2)
    ours = runs["ranks"][0]["flatshard_16_mixed"]
    assert ours["seen"] == [("wte", "torch.float16")]
    assert ours["scaler"] == "FlatShardGradScaler"
    ckpt = runs["ckpt"]["flatshard_16_mixed"]
    assert ckpt["FlatShardPrecision"]["scale"] == runs["ckpt"]["ddp_16_mixed"]["MixedPrecision"]["scale"]


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
