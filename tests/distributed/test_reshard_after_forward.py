"""``reshard_after_forward=k`` (see [Note: a node-local copy for backward]): FULL_SHARD over 4 gloo ranks as 2
"nodes" of 2. After forward each unit keeps a copy sharded over its node; backward gathers inside the node only.
Weights match the unsharded model; bytes are counted per process group; ``set_reshard_after_forward`` changes it
between steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.transport import groups
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
STEPS = 2


def _train(rank: int, world: int, options: dict[str, Any], change: Any = "unset") -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block}, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    handles = [h for s in unit_states(model) for h in s.handles]
    shard_state = groups.state_of(handles[0].shard_group)
    local = {id(s.node_group): s.node_group for s in unit_states(model) if s.node_group is not None}
    sent: list[dict[str, Any]] = []
    for step in range(STEPS):
        if step == 1 and change != "unset":
            flatshard.set_reshard_after_forward(model, change)
            local.update(
                {id(s.node_group): s.node_group for s in unit_states(model) if s.node_group is not None}
            )
        before = dict(shard_state.sent), {k: dict(groups.state_of(g).sent) for k, g in local.items()}
        idx, tgt = make_batch(step, PER_RANK * world)
        reference.loss(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model.loss(idx[mine], tgt[mine]).backward()
        opt.step()
        opt.zero_grad()
        node = sum(
            groups.state_of(g).sent["all_gather"] - before[1].get(k, {}).get("all_gather", 0)
            for k, g in local.items()
        )
        sent.append({"shard": shard_state.sent["all_gather"] - before[0].get("all_gather", 0), "node": node})
    held = [h._local for h in handles]
    with flatshard.unshard_params(model):
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    state, _ = flatshard.get_state_dict(model, rank0_only=False)
    return {"worst": worst, "sent": sent, "left": sum(x is not None for x in held), "state": state}


def _cases(rank: int, world: int) -> dict[str, Any]:
    return {
        "full": _train(rank, world, {}),
        "k2": _train(rank, world, {"reshard_after_forward": 2}),
        "bf16_prefetch": _train(
            rank, world, {"mixed_precision": {"param_dtype": "bf16"}, "forward_prefetch": True}
        ),
        "k2_bf16_prefetch": _train(
            rank,
            world,
            {
                "reshard_after_forward": 2,
                "mixed_precision": {"param_dtype": "bf16"},
                "forward_prefetch": True,
            },
        ),
        "k2_checkpointed": _train(
            rank, world, {"reshard_after_forward": 2, "activation_checkpointing_policy": {Block}}
        ),
        "switched": _train(rank, world, {}, change=2),
        "hybrid_k2": _train(
            rank,
            world,
            {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 4, "reshard_after_forward": 2},
        ),
    }


@pytest.mark.timeout(600)
def test_node_local_copy_for_backward() -> None:
    for rank, r in enumerate(spawn(_cases, 4)):
        for name, got in r.items():
            if "bf16" in name:  # against the same bf16 training without the copy: bit for bit
                plain = r["bf16_prefetch"]["state"]
                assert all(torch.equal(v, plain[k]) for k, v in got["state"].items()), (rank, name)
            else:
                assert got["worst"] < 1e-5, (rank, name, got["worst"])
            assert got["left"] == 0, (rank, name)  # no copy outlives its backward
        full, k2 = r["full"]["sent"], r["k2"]["sent"]
        # FULL_SHARD gathers every unit over all 4 ranks in forward and in backward (the root stays gathered)
        assert all(s["node"] == 0 for s in full)
        for s_full, s_k2 in zip(full, k2):
            # forward still gathers over the 4 ranks; backward only inside the node: each rank sends 2x its
            # shard there (its half of the node's copy), and nothing in backward crosses nodes
            assert 0 < s_k2["shard"] < s_full["shard"], (rank, s_full, s_k2)
            assert s_k2["node"] > 0, (rank, s_k2)
        assert r["switched"]["sent"][0]["node"] == 0 and r["switched"]["sent"][1]["node"] > 0, r["switched"]


def _errors(rank: int, world: int) -> list[str]:
    out = []
    for value in (3, -1, 2.5):
        try:
            flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, reshard_after_forward=value)
        except (TypeError, ValueError) as e:
            out.append(str(e))
    try:
        flatshard.shard(TinyGPT(), sharding_strategy="NO_SHARD", reshard_after_forward=2)
    except ValueError as e:
        out.append(str(e))
    return out


def test_reshard_after_forward_refuses_what_cannot_apply() -> None:
    errors = spawn(_errors, 2)[0]
    assert len(errors) == 4, errors
    assert "does not divide the shard group size 2" in errors[0] and "HINT" in errors[0]
    assert all("reshard_after_forward" in e for e in errors)
    assert "NO_SHARD" in errors[3]
