"""``FlatShardFabricStrategy(activation_checkpointing_mode=...)``: a model with dropout trains under Fabric with
selective checkpointing (or an operator list) exactly like the same model sharded by ``shard()`` without
checkpointing (losses, gradients, weights), and the option reaches ``shard()`` (see [Note: selective
checkpointing])."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import flatshard
from flatshard.engine.setup.activation_checkpointing import checkpointed_call
from flatshard.testing import spawn
from flatshard.testing.models import make_batch
from tests.dropout_models import DropoutBlock, dropout_gpt

STEPS = 3


def _steps(rank: int, world: int, model: Any, optimizer: Any, backward: Any) -> dict[str, Any]:
    mine = slice(2 * rank, 2 * rank + 2)
    losses, grads = [], []
    for step in range(STEPS):
        idx, tgt = make_batch(step, 2 * world)
        torch.manual_seed(100 * rank + step)  # the same dropout masks in both runs
        loss = F.cross_entropy(model(idx[mine]).flatten(0, 1), tgt[mine].flatten())
        backward(loss)
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None and p.grad.numel()])
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads}


def _run(rank: int, world: int, mode: Any) -> dict[str, Any]:
    strategy = flatshard.FlatShardFabricStrategy(
        auto_wrap_policy={DropoutBlock},
        activation_checkpointing_policy={DropoutBlock},
        activation_checkpointing_mode=mode,
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    reference = dropout_gpt()
    plain = flatshard.shard(
        copy.deepcopy(reference), auto_wrap_policy={DropoutBlock}
    )  # the same units, no checkpoints
    theirs = _steps(rank, world, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.Tensor.backward)
    model = copy.deepcopy(reference)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ours = _steps(rank, world, model, optimizer, fabric.backward)
    inner = model._forward_module
    weights, _ = flatshard.get_state_dict(inner, rank0_only=False)
    expected, _ = flatshard.get_state_dict(plain, rank0_only=False)
    return {
        "ours": ours,
        "theirs": theirs,
        "weight_diff": max((weights[k] - v).abs().max().item() for k, v in expected.items()),
        "contexts": sum(
            c.context_fn is not None for c in (checkpointed_call(m) for m in inner.modules()) if c is not None
        ),
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode",
    ["selective", pytest.param(["aten.mm", "aten.addmm"], marks=pytest.mark.slow)],
    ids=["selective", "ops"],
)
def test_fabric_selective_checkpointing_trains_like_no_checkpointing(mode: Any) -> None:
    for rank, r in enumerate(spawn(_run, 2, mode)):
        where = f"rank {rank}"
        assert r["contexts"] == 3, where
        torch.testing.assert_close(r["ours"]["losses"], r["theirs"]["losses"], rtol=0, atol=1e-6, msg=where)
        for mine, theirs in zip(r["ours"]["grads"], r["theirs"]["grads"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=where)
        assert r["weight_diff"] < 1e-6, (where, r["weight_diff"])
