"""The all-gather limiter on CUDA (``limit_all_gathers``; see [Note: rate limiter]).

A tower of units with small weights and much compute each, trained with forward and backward prefetch: the
CPU issues all-gathers faster than the GPU computes, so the limiter must block it on the free events of
earlier buffers. ``AllGatherLimiter.waits`` counts the times it waited on a pending free event; with the
limiter off it stays 0. How often the awaited event had not completed yet (the CPU really was ahead) is
recorded too; it depends on the transport (gloo on one GPU stages through the host and waits for the GPU at
every gather; NCCL does not), so it is reported, not asserted. Both runs match the unsharded model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn

from .cuda_common import max_abs_diff, rank_device, ranks_and_backend, reference_params, sharded_params

pytestmark = pytest.mark.gpu

WIDTH = 1024
DEPTH = 8  # units
REPEATS = 16  # matmuls per unit and forward: compute far outweighs the 2 MiB shard each gather moves
PER_RANK = 256
STEPS = 3


class Heavy(nn.Module):
    """One Linear applied ``REPEATS`` times: 4 MiB of weights, ~8.6 GFLOP per forward at ``PER_RANK`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        nn.init.normal_(self.lin.weight, std=WIDTH**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(REPEATS):
            x = torch.tanh(self.lin(x))
        return x


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Heavy() for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()


def _watch(limiter: Any) -> list[int]:
    """Count, in the returned list's one item, the waits whose free event had not completed yet."""
    ahead = [0]
    before = limiter.before_all_gather

    def watched() -> None:
        pending = list(limiter._free_events)
        if limiter.enabled and len(pending) >= limiter.max_in_flight and not pending[0][0].query():
            ahead[0] += 1
        before()

    limiter.before_all_gather = watched
    return ahead


def _run(rank: int, world: int, limit: bool) -> dict[str, Any]:
    device = rank_device(rank)
    torch.manual_seed(0)
    reference = Tower().to(device)
    model = copy.deepcopy(reference)
    flatshard.shard(
        model,
        auto_wrap_policy={Heavy},
        forward_prefetch=True,
        backward_prefetch="BACKWARD_PRE",
        limit_all_gathers=limit,
        device=device,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)

    def step() -> None:
        x = torch.randn(PER_RANK * world, WIDTH, generator=g).to(device)
        reference.loss(x).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        model.loss(x[rank * PER_RANK : (rank + 1) * PER_RANK]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the root's first forward creates the limiter; watch it from the second step on
    limiter = unit_states(model)[0].ctx.limiter
    limiter.waits = 0
    ahead = _watch(limiter)
    for _ in range(STEPS - 1):
        step()
    torch.cuda.synchronize(device)
    return {
        "waits": limiter.waits,
        "ahead": ahead[0],
        "in_flight_bound": limiter.max_in_flight,
        "weights": max_abs_diff(sharded_params(model), reference_params(reference)),
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("limit", [True, False], ids=["limited", "unlimited"])
def test_limiter_engages_when_gathers_outrun_compute(limit: bool) -> None:
    world, backend = ranks_and_backend()
    for rank, r in enumerate(spawn(_run, world, limit, backend=backend, timeout=600)):
        assert r["weights"] < 1e-4, (rank, r)
        if limit:
            # every gather after the first two frees of a step waits on an older free event
            assert r["waits"] >= (STEPS - 1) * DEPTH, (rank, r)
        else:
            assert r["waits"] == 0 and r["ahead"] == 0, (rank, r)
