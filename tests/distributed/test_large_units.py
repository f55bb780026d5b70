"""Units above the size where CPU blocks are mappings of their own (gathered parameters, flat gradients,
gradient shards): training matches the unsharded model, also accumulating gradients over micro-batches
(the gradient shards are mappings then too), and the mapped path is the one that ran."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine.shard import unit_states
from flatshard.engine.transport import memory
from flatshard.testing import spawn

pytestmark = pytest.mark.slow

STEPS = 3
PER_RANK = 4
MICRO = 2  # backward passes per optimizer step: reduced gradient shards add up across them


def _model() -> nn.Module:
    # 2048 x 2560 weights: 21 MB gathered, 10.5 MB shards on 2 ranks
    return nn.Sequential(nn.Linear(2048, 2560), nn.GELU(), nn.Linear(2560, 2048))


def _run(rank: int, world: int, strategy: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = _model()
    strategy, _, offload = strategy.partition("+")
    model = flatshard.shard(
        copy.deepcopy(reference),
        sharding_strategy=strategy,
        auto_wrap_policy={nn.Linear},
        cpu_offload=offload == "offload",
    )
    mapped: list[bool] = []
    for state in unit_states(model):
        for handle in state.handles:
            if handle.layout.padded_numel * 4 < 8 << 20:
                continue
            state.module.register_forward_pre_hook(
                lambda *_, h=handle: mapped.append(not h.flat.untyped_storage().resizable())
            )
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for _ in range(MICRO):
            x = torch.randn(PER_RANK * world, 2048, generator=g)
            local = x[rank * PER_RANK : (rank + 1) * PER_RANK]
            (model(local).square().mean() / MICRO).backward()
            (reference(x).square().mean() / MICRO).backward()
        with flatshard.unshard_params(model, with_grads=True):  # the gradient shards behind .grad, gathered
            for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert a.grad is not None, name
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if strategy != "NO_SHARD":  # one rank's shard is the whole unit: nothing to gather, no mapping
        assert mapped and (all(mapped) or not memory._CAN_SWAP), mapped
    with flatshard.unshard_params(model):
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD+offload"])
def test_large_units_match_the_unsharded_model(strategy: str) -> None:
    spawn(_run, 2, strategy)
