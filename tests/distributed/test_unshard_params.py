"""``flatshard.unshard_params``: full parameters and gradients between steps, write-back, rank-0 only."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.matrices import WORLD_AND_STRATEGY

GLOBAL = 12  # divisible by the world sizes used (2, 3)


def _setup(rank: int, world: int, strategy: str = "FULL_SHARD"):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    flatshard.shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
    idx, tgt = make_batch(0, GLOBAL)
    per = GLOBAL // world
    model.loss(idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]).backward()
    ref.loss(idx, tgt).backward()
    return ref, model


def _full_state(model):
    return flatshard.get_state_dict(model, rank0_only=False)[0]


def _check(rank: int, world: int, strategy: str) -> dict:
    ref, model = _setup(rank, world, strategy)
    out: dict = {}
    # inside: every parameter has its full shape and the reference's value; gradients too
    with flatshard.unshard_params(model, writeback=False, with_grads=True):
        out["values"] = all(
            p.shape == q.shape and torch.allclose(p, q) for p, q in zip(model.parameters(), ref.parameters())
        )
        out["grads"] = all(
            torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters())
        )
        for p in model.parameters():
            p.data.add_(1.0)
        with torch.no_grad():  # a forward runs on the (changed) full parameters
            expected = copy.deepcopy(ref)
            for p in expected.parameters():
                p.add_(1.0)
            out["forward_on_full"] = torch.allclose(model(make_batch(0, 2)[0]), expected(make_batch(0, 2)[0]))
        # saved state inside is the training state: the shards, not the changed full views
        inside = _full_state(model)
        out["state_is_the_shards"] = all(torch.allclose(v, ref.state_dict()[k]) for k, v in inside.items())
        try:  # loading inside is refused: leaving the context would write the full views back over it
            flatshard.set_state_dict(model, None, inside)
            out["load_refused"] = False
        except RuntimeError as err:
            out["load_refused"] = "unshard_params" in str(err)
    # writeback=False discarded the change; gradients are back on the shard views
    out["discarded"] = all(torch.allclose(v, ref.state_dict()[k]) for k, v in _full_state(model).items())
    out["grad_shapes_restored"] = all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
    # writeback=True keeps it
    with flatshard.unshard_params(model):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)
    expected = {k: v * 2 if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    out["written_back"] = all(torch.allclose(v, expected[k]) for k, v in _full_state(model).items())
    # rank0_only + writeback: rank 0's change reaches every rank; other ranks keep their pieces inside
    with flatshard.unshard_params(model, rank0_only=True, writeback=True):
        out["rank0_full"] = all(p.shape == q.shape for p, q in zip(model.parameters(), ref.parameters()))
        if rank == 0:
            with torch.no_grad():
                model.wte.weight.fill_(3.0)
    out["rank0_broadcast"] = bool((_full_state(model)["wte.weight"] == 3.0).all())
    # recurse=False: only the root unit's own parameters are full
    with flatshard.unshard_params(model, recurse=False):
        out["root_only"] = (
            model.wte.weight.shape == ref.wte.weight.shape
            and model.blocks[0].fc.weight.shape != ref.blocks[0].fc.weight.shape
            if world > 1 and strategy != "NO_SHARD"
            else True
        )
    # the model still trains after all this
    idx, tgt = make_batch(1, GLOBAL)
    per = GLOBAL // world
    model.loss(idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]).backward()
    out["trains"] = all(p.grad is not None for p in model.parameters())
    return out


@pytest.mark.parametrize(("world", "strategy"), WORLD_AND_STRATEGY)
def test_unshard_params(world: int, strategy: str):
    results = spawn(_check, world, strategy)
    for rank, r in enumerate(results):
        rank0 = r.pop("rank0_full")
        assert rank0 == (rank == 0 or strategy == "NO_SHARD" or world == 1), (rank, rank0)
        assert all(r.values()), (rank, r)


def test_recurse_false_needs_a_unit():
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    with pytest.raises(ValueError, match="not sharded"):
        with flatshard.unshard_params(model.ln_f, recurse=False):
            pass
