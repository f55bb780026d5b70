"""``reshard_root_after_forward``: the root unit frees its gathered parameters when its training forward returns
and gathers them again when backward reaches its outputs; training still equals the unsharded reference."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from flatshard.engine import ShardOptions, unit_states
from flatshard.engine.handle import HandleState
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

STEPS = 3
PER_RANK = 2


def _root_state(model: torch.nn.Module) -> HandleState:
    root = unit_states(model)[0]
    assert len(root.handles) == 1
    return root.handles[0].state


def _case(rank: int, world: int, strategy: str, prefetch: str | None, option: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy={Block},
        backward_prefetch=prefetch,
        reshard_root_after_forward=option,
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    after_forward = []
    worst_loss = 0.0
    for step in range(STEPS):
        idx, tgt = make_batch(step, PER_RANK * world)
        ref_loss = reference.loss(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        logits = model(idx[mine])  # the loss outside the model: what the option is for
        after_forward.append(_root_state(model).value)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[mine].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst_loss = max(worst_loss, abs(mean.item() / world - ref_loss.item()))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    worst_weight = max((full[k] - expected[k]).abs().max().item() for k in expected)
    with torch.no_grad():  # evaluation forwards reshard the root at once, with or without the option
        model(make_batch(0, PER_RANK)[0])
    return {
        "after_forward": after_forward,
        "after_eval": _root_state(model).value,
        "loss": worst_loss,
        "weight": worst_weight,
    }


def _all(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for strategy, prefetch, option in itertools.product(
        ["FULL_SHARD", "SHARD_GRAD_OP"], ["BACKWARD_PRE", "BACKWARD_POST", None], [True, False]
    ):
        out[f"{strategy}/{prefetch}/{option}"] = _case(rank, world, strategy, prefetch, option)
    return out


@pytest.mark.timeout(300)
def test_root_resharded_after_forward_and_training_unchanged() -> None:
    for rank, results in enumerate(spawn(_all, 2)):
        for case, r in results.items():
            option = case.endswith("True")
            expected = HandleState.SHARDED.value if option else HandleState.UNSHARDED.value
            assert r["after_forward"] == [expected] * STEPS, (rank, case, r)
            assert r["after_eval"] == HandleState.SHARDED.value, (rank, case, r)
            assert r["loss"] < 1e-5 and r["weight"] < 1e-5, (rank, case, r)


def test_refused_under_no_shard_and_checked_as_a_bool() -> None:
    with pytest.raises(ValueError, match="NO_SHARD"):
        ShardOptions(sharding_strategy="no_shard", reshard_root_after_forward=True)
    with pytest.raises(TypeError, match="reshard_root_after_forward must be a bool"):
        ShardOptions(reshard_root_after_forward="yes")  # type: ignore[arg-type]
    assert flatshard.FlatShardStrategy(
        reshard_root_after_forward=True
    ).options.shard.reshard_root_after_forward
