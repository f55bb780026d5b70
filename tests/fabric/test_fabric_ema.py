"""``flatshard.EMA`` in a Fabric loop: saved as pieces in a sharded checkpoint, resumed on another world size.

2 ranks train ``TinyGPT`` for two AdamW steps with an EMA updated after each, save ``{"model", "optimizer",
"ema": ema.sharded_state_dict()}`` (no gather); 3 ranks load it into a fresh model and EMA. The EMA equals a
plain EMA of one unsharded model trained on the whole batch, to 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT
from tests.distributed.test_dcp_interop import LR, STEPS, TOL, _loss

pytestmark = pytest.mark.slow

DECAY = 0.5


def _fabric(world: int) -> Fabric:
    strategy = flatshard.FlatShardFabricStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _save(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    fabric = _fabric(world)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    ema = flatshard.EMA(model.module, DECAY)
    for step in range(STEPS):
        fabric.backward(_loss(model, step, rank, world))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema.sharded_state_dict()})


def _load(rank: int, world: int, path: str) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    fabric = _fabric(world)
    torch.manual_seed(1)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    ema = flatshard.EMA(model.module, DECAY)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "ema": {}}
    fabric.load(path, state)
    ema.load_state(state["ema"])
    full = ema.full_state_dict()
    return full if rank == 0 else None


def test_fabric_ema_saved_as_pieces_resumes_on_another_world_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    shadow = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(STEPS):
        _loss(model, step, 0, 1).backward()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            shadow[n].lerp_(p.detach(), 1 - DECAY)
    spawn(_save, 2, str(tmp_path / "ckpt"))
    ema = spawn(_load, 3, str(tmp_path / "ckpt"))[0]
    for name, value in shadow.items():
        torch.testing.assert_close(ema[name], value, **TOL, msg=name)
