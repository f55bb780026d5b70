"""``FlatShardFabricStrategy(activation_offload=True)``: a Fabric loop trains exactly as without it on 2 CPU ranks
(same losses, gradients and weights, bit for bit: on CPU the hooks run without copies), with and without
activation checkpointing, for TinyGPT and a tiny Hugging Face Llama (see [Note: activation offload])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard import FlatShardFabricStrategy
from flatshard.engine import activation_offload_stats
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

STEPS = 3
PER_RANK = 2


def _loss(model_name: str, model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    if model_name == "llama":
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, 64, (PER_RANK * world, 12), generator=g)[mine]
        return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]
    idx, tgt = make_batch(step, PER_RANK * world)
    logits = model(idx[mine])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[mine].flatten())


def _train(rank: int, world: int, model_name: str, checkpointed: bool, offload: bool) -> dict[str, Any]:
    model: torch.nn.Module
    if model_name == "llama":
        from tests.hf.hf_common import tiny_llama  # transformers: only where a case needs it

        model, block = tiny_llama()
    else:
        torch.manual_seed(0)
        model, block = TinyGPT(), Block
    strategy = FlatShardFabricStrategy(
        auto_wrap_policy={block},
        activation_checkpointing_policy={block} if checkpointed else None,
        activation_offload=offload,
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = _loss(model_name, model, step, rank, world)
        fabric.backward(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    return {"losses": losses, "grads": grads, "weights": weights, "stats": activation_offload_stats(model)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return bool(a) and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _run(rank: int, world: int, cases: list[tuple[str, bool]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for model_name, checkpointed in cases:
        plain = _train(rank, world, model_name, checkpointed, offload=False)
        moved = _train(rank, world, model_name, checkpointed, offload=True)
        out[f"{model_name}/{'checkpointed' if checkpointed else 'plain'}"] = {
            "same": moved["losses"] == plain["losses"]
            and _same(moved["grads"], plain["grads"])
            and _same(moved["weights"], plain["weights"]),
            "stats": moved["stats"],
        }
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert r["same"], (rank, name)
            s = r["stats"]
            assert s.moved > 0 and s.records > 0 and s.unpacked > 0, (rank, name, s)
            assert s.prefetched > 0 and s.late == 0 and s.max_units_back <= 2, (rank, name, s)
            assert len(s.unit_bytes) == 3, (rank, name, s.unit_bytes)


@pytest.mark.timeout(300)
def test_fabric_activation_offload_parity() -> None:
    _check(spawn(_run, 2, [("gpt", False), ("gpt", True)]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fabric_activation_offload_hf_llama() -> None:
    _check(spawn(_run, 2, [("llama", False), ("llama", True)]))
