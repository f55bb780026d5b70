"""Float8 training (torchao ``Float8Linear`` with float8 all-gathers) through Fabric on 2 CPU ranks: exactly the
losses and weights of torchao's unsharded model under DDP; a full checkpoint saved by Fabric holds fp32 weights
(see [Note: float8 all-gathers])."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard import FlatShardFabricStrategy
from flatshard.testing import spawn

pytest.importorskip("torchao.float8")

STEPS = 3


def _train(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from tests.distributed.test_float8 import PER_RANK, Block, _batch, _float8_model, ddp_backward

    model = _float8_model("tensorwise")
    reference = copy.deepcopy(model)
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=FlatShardFabricStrategy(auto_wrap_policy={Block})
    )
    fabric.launch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diff = 0.0
    seen = []
    for step in range(STEPS):
        x = _batch(step, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        handle = model.module.blocks[1].down.register_forward_pre_hook(
            lambda m, _: seen.append(str(getattr(m.weight, "_data", m.weight).dtype))
        )
        loss = model(x).square().mean()
        handle.remove()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = ddp_backward(reference, x, world)
        ref_opt.step()
        ref_opt.zero_grad()
        diff = max(diff, abs(loss.item() - ref_loss))
    path = os.path.join(tmp, "fabric.ckpt")
    fabric.save(path, {"model": model})
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    weight_diff = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"loss": diff, "weights": weight_diff, "seen": seen}


def test_fabric_float8_matches_torchao_under_ddp(tmp_path: Any) -> None:
    for r in spawn(_train, 2, str(tmp_path)):
        assert r["loss"] <= 1e-6 and r["weights"] <= 1e-6, r
        assert set(r["seen"]) == {"torch.float8_e4m3fn"}, r["seen"]
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)["model"]
    assert saved and all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in saved.values())
