"""Fabric sharded checkpoints shared with Lightning's ``ModelParallelStrategy`` (torch FSDP2), both ways.

Fabric stores a state ``{"model": ..., "optimizer": ..., "step": 2}`` under the state's own names
(``model.*``, ``optimizer.state.*``, ``meta.pt``) with either strategy (see [Note: DCP-native layout]), so each
loads what the other wrote, on another world size. Both sides train ``TinyGPT`` for two AdamW steps on the same
global batch; the loaded state is compared with one unsharded model trained on the whole batch.
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
from tests.distributed.test_dcp_interop import LR, STEPS, _assert_matches, _loss, _named_state

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


def _parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fabric(world: int, which: str) -> Fabric:
    if which == "flatshard":
        strategy: Any = flatshard.FlatShardFabricStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    else:
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _save(rank: int, world: int, which: str, path: str) -> None:
    torch.set_num_threads(1)
    fabric = _fabric(world, which)
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    for step in range(STEPS):
        fabric.backward(_loss(model, step, rank, world))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})


def _load(rank: int, world: int, which: str, path: str) -> dict[str, Any] | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.set_num_threads(1)
    fabric = _fabric(world, which)
    torch.manual_seed(1)  # other weights: everything must come from the checkpoint
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    if which == "flatshard":
        weights, optim = flatshard.get_state_dict(model, optimizer.optimizer, full=True, rank0_only=True)
        named = _named_state(TinyGPT(), optim) if rank == 0 else {}
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights, optim = get_state_dict(model.module, optimizer.optimizer, options=options)
        named = optim["state"] if rank == 0 else {}
    return {"weights": weights, "state": named, "step": state["step"]} if rank == 0 else None


@pytest.mark.parametrize(
    ("writer", "reader"), [("model_parallel", "flatshard"), ("flatshard", "model_parallel")]
)
def test_fabric_sharded_checkpoints_move_between_model_parallel_and_flatshard(
    tmp_path: Path, writer: str, reader: str
) -> None:
    path = tmp_path / "ckpt"
    spawn(_save, 2, writer, str(path))
    result = spawn(_load, 3 if reader == "flatshard" else 2, reader, str(path))[0]
    _assert_matches(result["weights"], result["state"], f"Fabric {writer} -> {reader}")
    assert result["step"] == STEPS
