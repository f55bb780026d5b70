"""Selective activation checkpointing on a Hugging Face model (a tiny random Llama with attention dropout, built
from its config, no download): each decoder layer a unit, checkpointed with ``activation_checkpointing_mode``
"selective" or an operator list, trains on 2 ranks exactly like the same sharded model without checkpointing
(see [Note: selective checkpointing])."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine.setup.activation_checkpointing import checkpointed_call
from flatshard.testing import spawn

pytestmark = pytest.mark.slow

STEPS = 3
PER_RANK = 2
SEQ = 10


def _llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from .hf_common import build_config

    config = build_config("llama")
    config.attention_dropout = 0.2  # recomputed attention must draw the same mask
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train(model: torch.nn.Module, rank: int, world: int) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    data = torch.randint(3, 64, (STEPS, PER_RANK * world, SEQ), generator=g)
    losses, grads = [], []
    for step in range(STEPS):
        batch = data[step, rank * PER_RANK : (rank + 1) * PER_RANK]
        torch.manual_seed(100 * rank + step)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss  # training: no key-value cache
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None and p.grad.numel()])
        opt.step()
        opt.zero_grad()
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    return {"losses": losses, "grads": grads, "weights": weights}


def _run(rank: int, world: int, mode: Any) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.set_num_threads(1)
    reference = _llama()
    reference.train()
    plain, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    flatshard.shard(plain, auto_wrap_policy={LlamaDecoderLayer})
    flatshard.shard(
        ours,
        auto_wrap_policy={LlamaDecoderLayer},
        activation_checkpointing_policy={LlamaDecoderLayer},
        activation_checkpointing_mode=mode,
    )
    a, b = _train(ours, rank, world), _train(plain, rank, world)
    return {
        "contexts": sum(
            c.context_fn is not None for c in (checkpointed_call(m) for m in ours.modules()) if c is not None
        ),
        "loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "grad_diff": max(
            (x - y).abs().max().item()
            for ga, gb in zip(a["grads"], b["grads"], strict=True)
            for x, y in zip(ga, gb, strict=True)
        ),
        "weight_diff": max((a["weights"][k] - v).abs().max().item() for k, v in b["weights"].items()),
        "dropout": reference.config.attention_dropout,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["selective", ["aten.mm", "aten.bmm"]], ids=["selective", "ops"])
def test_hf_llama_selective_checkpointing_trains_like_no_checkpointing(mode: Any) -> None:
    for rank, r in enumerate(spawn(_run, 2, mode)):
        where = f"rank {rank}: {r}"
        assert r["contexts"] == 2 and r["dropout"] > 0, where  # both decoder layers
        assert r["loss_diff"] < 1e-6 and r["grad_diff"] < 1e-6 and r["weight_diff"] < 1e-6, where


def test_a_key_value_cache_in_training_is_explained() -> None:
    """With ``use_cache=True`` the forward grows a cache that the recomputation reads: torch's replay error comes out
    of backward naming the layer, the cause and the fix."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _llama()
    flatshard.shard(
        model,
        auto_wrap_policy={LlamaDecoderLayer},
        activation_checkpointing_policy={LlamaDecoderLayer},
        activation_checkpointing_mode="selective",
    )
    batch = torch.randint(3, 64, (2, SEQ))
    loss = model(input_ids=batch, labels=batch, use_cache=True).loss
    with pytest.raises(
        RuntimeError, match=r"LlamaDecoderLayer.*use_cache=True.*HINT: train with use_cache=False"
    ):
        loss.backward()
