"""The Trainer on GPUs (NCCL, one rank per GPU): flatshard under bf16-mixed, 16-mixed (the sharded grad
scaler) and with CPU offload, against DDP with the same precision flag. Run with `python -m pytest -m gpu`.

Under 16-mixed flatshard's gradients come out of fp16 weights (embeddings and norms too), where DDP's come out
of fp32 weights; at the default initial scale of 2**16 the tiny GPT's embedding gradient overflows fp16 for
flatshard (and for torch FSDP with ``param_dtype=float16``) but not for DDP, so flatshard skips the first steps
while the scaler backs off. The comparison therefore starts both scalers at 2**10, where neither skips, and
checks that: weights can only agree step by step when both took the same steps."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block

from ..lightning.lit_common import (
    LitGPT,
    LossRecorder,
    assert_runs_close,
    load_ckpt,
    make_loader,
    make_trainer,
)

pytestmark = pytest.mark.gpu

STEPS = 4
PER_RANK = 2


def _fp16_mixed() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cuda", torch.amp.GradScaler("cuda", init_scale=2.0**10))


# name -> (strategy factory, Trainer arguments); SGD keeps the comparison linear in the gradients
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "ddp_bf16": (lambda: "ddp", {"precision": "bf16-mixed"}),
    "flatshard_bf16": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        {"precision": "bf16-mixed"},
    ),
    "ddp_16": (lambda: "ddp", {"plugins": [_fp16_mixed()], "gradient_clip_val": 0.5}),
    "flatshard_16": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        {"plugins": [_fp16_mixed()], "gradient_clip_val": 0.5},
    ),
    "flatshard_offload_bf16": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}, cpu_offload=True),
        {"precision": "bf16-mixed"},
    ),
}


def _train_all(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    results: dict[str, Any] = {}
    for name, (make_strategy, extra) in CASES.items():
        model = LitGPT(optimizer="sgd", lr=0.1)
        recorder = LossRecorder()
        trainer = make_trainer(
            world, make_strategy(), accelerator="gpu", max_epochs=1, callbacks=[recorder], **extra
        )
        trainer.fit(model, make_loader(STEPS, PER_RANK * world, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{name}.ckpt"))
        shards = [h.sharded for s in flatshard.engine.unit_states(model.model) for h in s.handles]
        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        results[name] = {
            "losses": recorder.losses,
            "scale": None if scaler is None else float(scaler.get_scale()),
            "scaler": None if scaler is None else type(scaler).__name__,
            "plugin": type(trainer.strategy.precision_plugin).__name__,
            "shard_devices": sorted({str(t.device.type) for t in shards}),
            "pinned": all(t.is_pinned() for t in shards)
            if shards and shards[0].device.type == "cpu"
            else None,
        }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("cuda_trainer")
    ranks = spawn(_train_all, torch.cuda.device_count(), str(directory), backend="nccl", timeout=900)
    return {"ranks": ranks, "ckpt": {n: load_ckpt(directory / f"{n}.ckpt") for n in CASES}}


def _close(ours: str, theirs: str, runs: dict[str, Any], tol: float) -> None:
    assert_runs_close(runs, ours, theirs, STEPS, tol)
    state = runs["ckpt"][ours]["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}  # fp32 masters


@pytest.mark.timeout(900)
def test_bf16_mixed_matches_ddp_on_gpus(runs: dict[str, Any]) -> None:
    _close("flatshard_bf16", "ddp_bf16", runs, tol=2e-2)
    assert runs["ranks"][0]["flatshard_bf16"]["plugin"] == "FlatShardPrecision"
    assert runs["ranks"][0]["flatshard_bf16"]["shard_devices"] == ["cuda"]


@pytest.mark.timeout(900)
def test_fp16_mixed_with_the_sharded_scaler_matches_ddp_on_gpus(runs: dict[str, Any]) -> None:
    ours, theirs = runs["ranks"][0]["flatshard_16"], runs["ranks"][0]["ddp_16"]
    assert ours["scaler"] == "FlatShardGradScaler", ours
    assert ours["scale"] == theirs["scale"] == 2.0**10, (ours, theirs)  # no step skipped by either run
    _close("flatshard_16", "ddp_16", runs, tol=2e-2)


@pytest.mark.timeout(900)
def test_cpu_offload_keeps_pinned_shards_and_matches_ddp(runs: dict[str, Any]) -> None:
    _close("flatshard_offload_bf16", "ddp_bf16", runs, tol=2e-2)
    offload = runs["ranks"][0]["flatshard_offload_bf16"]
    assert offload["shard_devices"] == ["cpu"] and offload["pinned"] is True
