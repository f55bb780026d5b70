"""``flatshard.register_forward_method``: a method other than forward (``generate``) on a module inside a
sharded model gathers like the root's forward; units stay gathered across the decode loop (or not), are
freed when it returns, and training afterwards still matches the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.handle import HandleState
from flatshard.engine.transport import comm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.matrices import WORLD_AND_STRATEGY

NEW_TOKENS = 6


class Holder(nn.Module):
    """A LightningModule-like root: the language model is an attribute, its embeddings belong to the root."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyGPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(idx)

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(idx).flatten(0, 1), target.flatten())


def _case(rank: int, world: int, strategy: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = Holder()
    model = flatshard.shard(copy.deepcopy(ref), sharding_strategy=strategy, auto_wrap_policy={Block})
    prompt = make_batch(0, 2)[0][:, :3]
    expected = ref.lm.generate(prompt, NEW_TOKENS)
    out: dict = {}
    try:  # not registered: the root's parameters are still 1-D pieces there
        model.lm.generate(prompt, NEW_TOKENS)
        out["unregistered_fails"] = strategy == "NO_SHARD" or world == 1
    except RuntimeError:
        out["unregistered_fails"] = True
    units = [s for s in unit_states(model) if s.handles]
    for s in units:  # a failed call must leave nothing gathered or half-entered
        s.reshard()
        s.forward_depth = 0
    flatshard.register_forward_method(model.lm, "generate", keep_gathered=False)
    comm.comm_stats.clear()
    out["regather_each_token"] = torch.equal(model.lm.generate(prompt, NEW_TOKENS), expected)
    regather_bytes = comm.comm_stats["all_gather"]
    flatshard.register_forward_method(model.lm, "generate")  # keep_gathered=True, the default
    comm.comm_stats.clear()
    out["kept_gathered"] = torch.equal(model.lm.generate(prompt, NEW_TOKENS), expected)
    kept_bytes = comm.comm_stats["all_gather"]
    if strategy != "NO_SHARD":
        # each unit gathered once, instead of once per token (the root is gathered once in both)
        out["fewer_gathers"] = 0 < kept_bytes < regather_bytes / 2
    out["all_resharded"] = all(h.state is HandleState.SHARDED for s in units for h in s.handles)
    out["all_idle"] = all(s.forward_depth == 0 for s in unit_states(model))
    # inside unshard_params: no collective; rank 0 alone with rank0_only
    with flatshard.unshard_params(model, writeback=False):
        comm.comm_stats.clear()
        out["in_unshard_params"] = torch.equal(model.lm.generate(prompt, NEW_TOKENS), expected)
        out["no_collectives"] = sum(comm.comm_stats.values()) == 0
    with flatshard.unshard_params(model, rank0_only=True, writeback=False):
        if rank == 0:
            out["rank0_alone"] = torch.equal(model.lm.generate(prompt, NEW_TOKENS), expected)
    # training afterwards matches the unsharded model, and the recorded order (prefetch) survived
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        idx, tgt = make_batch(step, 6)
        per = 6 // world
        model.loss(idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        ref.loss(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            flatshard.register_forward_method(model.lm, "generate")
            model.lm.generate(prompt, 2)  # between training steps
    with flatshard.unshard_params(model):
        out["trains_like_reference"] = all(
            torch.allclose(p, q, atol=1e-5) for p, q in zip(model.parameters(), ref.parameters())
        )
    ctx = unit_states(model)[0].ctx
    out["order_kept"] = ctx is not None and ctx.order.valid
    return out


@pytest.mark.parametrize(("world", "strategy"), WORLD_AND_STRATEGY)
def test_registered_generate(world: int, strategy: str) -> None:
    for rank, result in enumerate(spawn(_case, world, strategy)):
        assert [k for k, v in result.items() if not v] == [], (rank, result)


def test_registration_errors() -> None:
    model = Holder()
    with pytest.raises(ValueError, match="not inside a module sharded"):
        flatshard.register_forward_method(model.lm, "generate")
    flatshard.shard(model)
    with pytest.raises(ValueError, match="forward already gathers"):
        flatshard.register_forward_method(model.lm, "forward")
    with pytest.raises(ValueError, match="no method 'sample'"):
        flatshard.register_forward_method(model.lm, "sample")
    flatshard.register_forward_method(model.lm, "generate")
    copied = copy.deepcopy(model)  # the copy's method runs on the copy
    assert copied.lm.generate.module is copied.lm
