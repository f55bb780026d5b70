"""Meta-device init through the Trainer: ``configure_model`` on ``torch.device("meta")`` with a
``param_init_fn``, and ``trainer.init_module(empty_init=True)`` with ``reset_parameters``, on 2 ranks.

The first is compared with DDP on an eagerly built model given the same name-seeded initial values.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT

from ..distributed.test_meta_init import name_seeded_init
from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    load_ckpt,
    make_loader,
    make_trainer,
    strip_prefix,
)

pytestmark = pytest.mark.slow

STEPS = 3


class ConfiguredGPT(LitGPT):
    """Builds its model in ``configure_model``: on the meta device for flatshard, eagerly for DDP."""

    def __init__(self, meta: bool, optimizer: str = "groups") -> None:
        super().__init__(optimizer=optimizer)  # grouped by p.ndim: built on the meta shapes, then re-pointed
        self.model = None  # type: ignore[assignment]
        self.meta = meta

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.meta:
            with torch.device("meta"):
                self.model = TinyGPT()
            return
        self.model = TinyGPT()
        init = name_seeded_init({m: n for n, m in self.named_modules()})
        with torch.no_grad():
            for m in self.modules():
                init(m)
            init(self.model.wte)  # the tied weight's first holder wins, as in flatshard's materialization


def _init_from(lit: nn.Module):  # type: ignore[no-untyped-def]
    def init(module: nn.Module) -> None:
        name_seeded_init({m: n for n, m in lit.named_modules()})(module)

    return init


def _train(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in ("ddp", "flatshard_meta"):
        lit = ConfiguredGPT(meta=name != "ddp")
        strategy: Any = "ddp"
        if name != "ddp":
            strategy = flatshard.FlatShardStrategy(auto_wrap_policy={Block}, param_init_fn=_init_from(lit))
        recorder = LossRecorder()
        trainer = make_trainer(world, strategy, max_epochs=1, callbacks=[recorder])
        trainer.fit(lit, make_loader(STEPS, 2 * world, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{name}.ckpt"))
        results[name] = recorder.losses
    # Adagrad makes state in its constructor, here for meta parameters: configure_optimizers runs again on the
    # shards, and training matches DDP's
    adagrad: dict[str, Any] = {}
    for name in ("ddp", "flatshard_meta"):
        lit = ConfiguredGPT(meta=name != "ddp", optimizer="adagrad")
        strategy = "ddp" if name == "ddp" else flatshard.FlatShardStrategy(param_init_fn=_init_from(lit))
        trainer = make_trainer(world, strategy, max_epochs=1)
        trainer.fit(lit, make_loader(STEPS, 2 * world, world))
        adagrad[name] = (
            flatshard.get_state_dict(lit, rank0_only=False)[0] if name != "ddp" else lit.state_dict()
        )
    results["adagrad_meta"] = max(
        (adagrad["flatshard_meta"][k] - v).abs().max().item() for k, v in adagrad["ddp"].items()
    )
    # init_module(empty_init=True): the LightningModule's own __init__ builds on meta; reset_parameters() runs
    trainer = make_trainer(world, "flatshard", max_epochs=1)
    with trainer.init_module(empty_init=True):
        lit = LitGPT()
    results["empty_init_meta"] = all(p.is_meta for p in lit.parameters())
    trainer.fit(lit, make_loader(STEPS, 2 * world, world))
    full, _ = flatshard.get_state_dict(lit, rank0_only=False)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, full)
    results["empty_init_ranks_agree"] = all(torch.equal(gathered[0][k], gathered[-1][k]) for k in full)
    results["empty_init_finite"] = all(bool(torch.isfinite(v.float()).all()) for v in full.values())
    return results


@pytest.mark.timeout(300)
def test_meta_init_through_the_trainer(tmp_path: Any) -> None:
    ranks = spawn(_train, 2, str(tmp_path))
    r = ranks[0]
    for a, b in zip(r["flatshard_meta"], r["ddp"], strict=True):
        assert abs(a - b) <= 1e-5, (r["flatshard_meta"], r["ddp"])
    ours_ckpt, theirs_ckpt = load_ckpt(tmp_path / "flatshard_meta.ckpt"), load_ckpt(tmp_path / "ddp.ckpt")
    ours, theirs = strip_prefix(ours_ckpt["state_dict"]), strip_prefix(theirs_ckpt["state_dict"])
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5, msg=key)
    assert len(ours_ckpt["optimizer_states"][0]["param_groups"]) == 3  # groups made from the meta shapes
    assert_same_optimizer_state(
        ours_ckpt["optimizer_states"][0], theirs_ckpt["optimizer_states"][0], "meta flatshard vs ddp"
    )
    assert r["empty_init_meta"] and r["empty_init_ranks_agree"] and r["empty_init_finite"], r
    assert r["adagrad_meta"] < 1e-5, r
