"""Sharding is real: each rank holds ~1/N of the parameter, gradient and optimizer-state bytes."""

from __future__ import annotations

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _run(rank: int, world: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=101, d_model=64, n_layer=4)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flatshard.shard(model, auto_wrap_policy={Block})
    after_setup = _storage_bytes(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, tgt = make_batch(0, 2, vocab=101)
    model.loss(idx, tgt).backward()
    opt.step()
    grads = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
    states = _storage_bytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return {
        "full": full_bytes,
        "params": after_setup,
        "grads": grads,
        "optim": states,
        "units": len([m for m in model.modules() if flatshard.is_sharded(m)]),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_rank_holds_its_share(world_size: int) -> None:
    for r in spawn(_run, world_size):
        share = r["full"] / world_size
        slack = 4 * world_size * r["units"]  # padding: < world elements of 4 bytes per unit
        assert r["params"] <= share + slack, r
        assert r["params"] >= share - slack, r
        assert r["grads"] <= share + slack, r
        assert r["optim"] <= 2 * share + 2 * slack, r  # exp_avg + exp_avg_sq
