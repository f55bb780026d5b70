"""Hybrid sharding on GPUs: 4 ranks as 2 shard groups of 2 (``shard_group_size=2``), against the unsharded model.

Needs 2 GPUs or more: one rank per GPU over NCCL with 4 GPUs or more, else 4 ranks spread over the GPUs over
gloo (two per GPU), so the shard and replicate groups span devices either way.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.transport import comm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from .cuda_common import max_abs_diff, rank_device, ranks_and_backend, reference_params, sharded_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="hybrid sharding on GPUs needs 2 GPUs or more"),
]

WORLD = 4
PER_RANK = 2
STEPS = 3


def _run(rank: int, world: int) -> dict[str, Any]:
    device = rank_device(rank)
    out: dict[str, Any] = {}
    for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        torch.manual_seed(0)
        reference = TinyGPT().to(device)
        model = copy.deepcopy(reference)
        flatshard.shard(
            model, sharding_strategy=strategy, auto_wrap_policy={Block}, shard_group_size=2, device=device
        )
        handles = [h for s in unit_states(model) for h in s.handles]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        comm.comm_stats.clear()
        for step in range(STEPS):
            idx, tgt = (t.to(device) for t in make_batch(step, PER_RANK * world))
            reference.loss(idx, tgt).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            model.loss(idx[mine], tgt[mine]).backward()
            flatshard.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
        out[strategy] = {
            "weights": max_abs_diff(sharded_params(model), reference_params(reference)),
            "groups": sorted({(h.shard_world, h.replicate_world) for h in handles}),
            "shard_devices": sorted({h.sharded.device.type for h in handles}),
            "replicated_bytes": comm.comm_stats["all_reduce"],
        }
    return out


@pytest.mark.timeout(600)
def test_hybrid_sharding_on_gpus_matches_reference() -> None:
    world, backend = ranks_and_backend(WORLD)
    for rank, r in enumerate(spawn(_run, world, backend=backend, timeout=600)):
        for strategy, m in r.items():
            assert m["weights"] < 1e-4, (rank, strategy, m)
            assert m["groups"] == [(2, 2)] and m["shard_devices"] == ["cuda"], (rank, strategy, m)
            assert m["replicated_bytes"] > 0, (rank, strategy, m)  # gradient shards crossed the groups
