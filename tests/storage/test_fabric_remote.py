"""``fabric.save`` / ``fabric.load`` with URLs: ``s3://`` on a real S3-compatible server (see conftest.py) on 2
ranks, and ``memory://`` in one process (fsspec's in-memory filesystem lives in one process only). Both
``state_dict_type``s; the loaded state equals the saved one exactly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard.checkpoint import is_sharded_checkpoint
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _setup(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _round_trip(rank: int, world: int, url: str, cwd: str) -> dict[str, Any]:
    """Save one trained state per state_dict_type to ``url``, load each into a fresh model on the same ranks."""
    os.chdir(cwd)
    out: dict[str, Any] = {}
    for kind in ("sharded", "full"):
        strategy = flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block}, state_dict_type=kind)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model, optimizer = _setup(fabric, seed=0)
        idx, tgt = make_batch(0, 2 * world)
        fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
        optimizer.step()
        target = f"{url}/{kind}"
        fabric.save(target, {"model": model, "optimizer": optimizer, "step": 5})
        expected = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
        fresh, fresh_optimizer = _setup(fabric, seed=123)
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        rest = fabric.load(target, state)
        actual = flatshard.get_state_dict(fresh, fresh_optimizer.optimizer, rank0_only=False)
        out[kind] = {
            "weights": max((actual[0][k] - v).abs().max().item() for k, v in expected[0].items()),
            "optim": max(
                (actual[1]["state"][i]["exp_avg"] - s["exp_avg"]).abs().max().item()
                for i, s in expected[1]["state"].items()
            ),
            "step": state["step"],
            "rest": rest,
            "sharded": is_sharded_checkpoint(target),
        }
    return out


def _check(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for kind in ("sharded", "full"):
            assert rank[kind] == {
                "weights": 0.0,
                "optim": 0.0,
                "step": 5,
                "rest": {},
                "sharded": kind == "sharded",
            }, (kind, rank[kind])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fabric_saves_and_loads_on_s3(s3_url: str, local_cwd: Path) -> None:
    _check(spawn(_round_trip, 2, s3_url, str(local_cwd)))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fabric_saves_and_loads_in_memory(local_cwd: Path) -> None:
    _check(spawn(_round_trip, 1, "memory://fabric-test", str(local_cwd)))
