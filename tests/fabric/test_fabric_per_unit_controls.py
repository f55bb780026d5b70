"""``flatshard.set_requires_gradient_sync`` and ``set_requires_all_reduce`` from a Fabric loop, on the module
``fabric.setup`` returned: accumulation over 2 micro-batches trains as the unsharded model on the same global
batches, and the units followed the flags."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.fabric import Fabric

import flatshard
from flatshard import FlatShardFabricStrategy
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
MICRO = 2


def _train(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=FlatShardFabricStrategy(auto_wrap_policy={Block})
    )
    fabric.launch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    kept = []
    for step in range(2):
        for m in range(MICRO):
            last = m == MICRO - 1
            flatshard.set_requires_gradient_sync(model, last)
            flatshard.set_requires_all_reduce(model, last)  # no replicas here: no effect, accepted
            idx, tgt = make_batch(step * MICRO + m, PER_RANK * world)
            (reference.loss(idx, tgt) / MICRO).backward()
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            logits = model(idx[mine])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[mine].flatten()) / MICRO
            fabric.backward(loss)
            kept.append(sum(h.has_unsynced for s in unit_states(model) for h in s.handles))
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    worst = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"worst": worst, "kept": kept}


def test_fabric_loop_sets_gradient_sync_per_step() -> None:
    for r in spawn(_train, 2):
        assert r["worst"] < 1e-5, r
        units = r["kept"][0]
        assert units > 0 and r["kept"] == [units, 0, units, 0], r["kept"]  # unsharded kept, then reduced
