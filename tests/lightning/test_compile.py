"""Trainer with torch.compile: ``FlatShardStrategy(compile=...)`` and ``block.compile()`` in ``configure_model``
train like eager DDP, without a graph break or a dynamo warning, compiling nothing new after the second step.
A ``torch.compile``d LightningModule is refused by Lightning itself (see the guide's torch.compile section).

One spawn of 2 ranks runs every case (dynamo is reset between them); ``aot_eager`` keeps compiling cheap.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.testing import spawn
from flatshard.testing.dynamo import DynamoWatch, watch_dynamo
from flatshard.testing.models import Block

from .lit_common import LitGPT, LossRecorder, assert_runs_close, load_ckpt, make_loader, make_trainer

STEPS = 4
BACKEND = "aot_eager"


class BlocksCompiledGPT(LitGPT):
    """Compiles its blocks in ``configure_model``, before the strategy shards them."""

    def configure_model(self) -> None:
        for blk in self.model.blocks:
            blk.compile(backend=BACKEND)


class _EachStep(Callback):
    def __init__(self, watch: DynamoWatch) -> None:
        self.watch = watch

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.watch.step()


# name -> (strategy factory, module factory)
CASES: dict[str, tuple[Any, Any]] = {
    "ddp": (lambda: "ddp", LitGPT),
    "compile_argument": (
        lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}, compile={"backend": BACKEND}),
        LitGPT,
    ),
    "configure_model": (lambda: flatshard.FlatShardStrategy(auto_wrap_policy={Block}), BlocksCompiledGPT),
    "compile_argument_grad_op": (
        lambda: flatshard.FlatShardStrategy(
            sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block}, compile={"backend": BACKEND}
        ),
        LitGPT,
    ),
}


def _fit_all(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (make_strategy, make_module) in CASES.items():
        with watch_dynamo() as watch:
            model = make_module()
            recorder = LossRecorder()
            trainer = make_trainer(
                world, make_strategy(), max_epochs=1, callbacks=[recorder, _EachStep(watch)]
            )
            trainer.fit(model, make_loader(STEPS, 2 * world, world))
            trainer.save_checkpoint(os.path.join(out_dir, f"{name}.ckpt"))
        compiled = [blk._compiled_call_impl is not None for blk in model.model.blocks]
        results[name] = {"losses": recorder.losses, "compiled": compiled, **watch.summary()}
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_units_train_like_eager_ddp(tmp_path: Any) -> None:
    ranks = spawn(_fit_all, 2, str(tmp_path))
    runs = {"ranks": ranks, "ckpt": {name: load_ckpt(tmp_path / f"{name}.ckpt") for name in CASES}}
    for name in CASES:
        if name == "ddp":
            continue
        assert_runs_close(runs, name, "ddp", STEPS, 1e-5)
        for rank, results in enumerate(ranks):
            r = results[name]
            where = f"rank {rank} {name}: {r}"
            assert r["compiled"] == [True, True, True], where
            assert r["breaks"] == {} and r["warnings"] == [], where
            graphs = r["graphs"]
            assert len(graphs) == STEPS and graphs[0] == graphs[-1] == 1 and r["calls_captured"] > 0, where


def test_compile_argument_is_checked_when_the_strategy_is_built() -> None:
    with pytest.raises(TypeError, match=r"compile must be a bool or a dict.*HINT: a mode goes in a dict"):
        flatshard.FlatShardStrategy(compile="max-autotune")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys that torch.compile does not take: \['fullgrpah'\]. HINT"):
        flatshard.FlatShardStrategy(compile={"fullgrpah": True})
    with pytest.raises(ValueError, match=r"2 options are wrong:(.|\n)*state_dict_type(.|\n)*compile must be"):
        flatshard.FlatShardStrategy(state_dict_type="both", compile=1)  # type: ignore[arg-type]
    assert flatshard.FlatShardStrategy(compile=True).options.compile == {}
    assert flatshard.FlatShardStrategy().options.compile is None


def test_trainer_refuses_a_torch_compiled_lightning_module() -> None:
    """Lightning's own check (``_verify_strategy_supports_compile``): only its SingleDevice, DDP and FSDP
    strategies take a ``torch.compile``d LightningModule. The guide says what to write instead."""
    trainer = make_trainer(2, flatshard.FlatShardStrategy(auto_wrap_policy={Block}))
    compiled: Any = torch.compile(LitGPT())
    with pytest.raises(
        RuntimeError, match="Only SingleDeviceStrategy, DDPStrategy, FSDPStrategy support compil"
    ):
        trainer.fit(compiled, make_loader(1, 4, 2))
    # Refused before anything ran: no step, nothing sharded, the weights still the seeded initial ones.
    assert trainer.global_step == 0
    initial = LitGPT().state_dict()
    after = compiled._orig_mod.state_dict()
    assert sorted(after) == sorted(initial)
    for key, value in initial.items():
        assert after[key].shape == value.shape and torch.equal(after[key], value), key
