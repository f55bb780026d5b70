"""Fabric with torch.compile: ``fabric.setup(torch.compile(model))`` and the strategy's ``compile`` argument train
like the eager, unsharded reference, without a graph break or a dynamo warning, compiling nothing new after the
second step. Fabric unwraps a compiled model, lets the strategy shard it and compiles the sharded model again;
sharding sealed the root's forward, so that compiles each unit's forward (see [Note: torch.compile]).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch._dynamo import OptimizedModule

import flatshard
from flatshard.testing import spawn
from flatshard.testing.dynamo import watch_dynamo
from flatshard.testing.models import Block, TinyGPT, make_batch

pytestmark = pytest.mark.slow

STEPS = 4
BACKEND = "aot_eager"

CASES = {  # name -> (strategy arguments, compile the model before fabric.setup)
    "setup(torch.compile(model))": ({}, True),
    "compile_argument": ({"compile": {"backend": BACKEND}}, False),
}


def _run_case(rank: int, world: int, strategy_args: dict[str, Any], wrap: bool) -> dict[str, Any]:
    strategy = flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block}, **strategy_args)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    with watch_dynamo() as watch:
        torch.manual_seed(0)
        reference = TinyGPT()
        model: Any = copy.deepcopy(reference)
        if wrap:
            model = torch.compile(model, backend=BACKEND)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        mine = slice(2 * rank, 2 * rank + 2)
        loss_diff = 0.0
        for step in range(STEPS):
            idx, tgt = make_batch(step, 2 * world)
            ref_loss = reference.loss(idx, tgt)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(idx[mine]).flatten(0, 1), tgt[mine].flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loss_diff = max(loss_diff, abs(fabric.all_reduce(loss.detach()).item() - ref_loss.item()))
            watch.step()
    full, _ = flatshard.get_state_dict(model._original_module, rank0_only=False)
    weights = max(
        (full[k] - v).abs().max().item() for k, v in reference.state_dict().items() if v.is_floating_point()
    )
    return {
        "loss": loss_diff,
        "weights": weights,
        "wrapped": isinstance(model._forward_module, OptimizedModule),
        **watch.summary(),
    }


def _run_all(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: _run_case(rank, world, *case) for name, case in CASES.items()}


@pytest.mark.timeout(300)
def test_fabric_compiled_training_matches_eager_reference() -> None:
    for rank, results in enumerate(spawn(_run_all, 2)):
        for name, r in results.items():
            where = f"rank {rank} {name}: {r}"
            assert r["loss"] < 1e-5 and r["weights"] < 1e-5, where
            assert r["wrapped"] == CASES[name][1], where  # Fabric compiled the sharded model again
            assert r["breaks"] == {} and r["warnings"] == [], where
            graphs = r["graphs"]
            assert graphs[0] == graphs[-1] == 1 and r["calls_captured"] > 0, where
