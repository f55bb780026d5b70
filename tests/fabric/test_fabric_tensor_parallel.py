"""Tensor parallelism through Fabric: ``FlatShardFabricStrategy(tensor_parallel_size=2)`` on 4 CPU ranks builds the
("data_parallel", "tensor_parallel") mesh, the loop applies the plan on ``fabric.strategy.device_mesh`` before
``fabric.setup``, and training matches one process on the same global batch; a full save holds plain tensors of
the original shapes, and a sharded one loads back (see [Note: tensor parallelism])."""

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
from tests.tp_models import VOCAB, Block, TPLlama, llama_loss, llama_plan

STEPS, GLOBAL_BATCH = 3, 8


def _train(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = FlatShardFabricStrategy(
        tensor_parallel_size=2, auto_wrap_policy={Block}, state_dict_type="sharded"
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    mesh = fabric.strategy.device_mesh
    assert mesh.mesh_dim_names == ("data_parallel", "tensor_parallel") and tuple(mesh.shape) == (2, 2)
    torch.manual_seed(0)
    model = TPLlama()
    reference = copy.deepcopy(model)
    llama_plan(model, mesh["tensor_parallel"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    dp_rank = mesh["data_parallel"].get_local_rank()
    diff = 0.0
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(step))
        loss = llama_loss(model, tokens.chunk(2)[dp_rank])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = llama_loss(reference, tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
        diff = max(diff, abs(float(mean) - ref_loss.item()))
    fabric.save(os.path.join(tmp, "sharded"), {"model": model, "optimizer": optimizer})
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    weight_diff = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    state = {"model": model, "optimizer": optimizer}
    fabric.load(os.path.join(tmp, "sharded"), state)
    reloaded, _ = flatshard.get_state_dict(model, rank0_only=False)
    reload_diff = max((reloaded[k] - v).abs().max().item() for k, v in weights.items())
    return {"loss": diff, "weights": weight_diff, "reload": reload_diff}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fabric_tensor_parallel_matches_one_process(tmp_path: Any) -> None:
    for r in spawn(_train, 4, str(tmp_path)):
        assert r["loss"] <= 1e-5 and r["weights"] <= 3e-4 and r["reload"] == 0, r
