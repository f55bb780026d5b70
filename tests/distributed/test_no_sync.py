"""Gradient accumulation on 2 ranks, both ways: reduce-scatter every micro-batch (sharded gradients add up)
and ``flatshard.no_sync`` (unsharded gradients add up, one reduction per step), against an unsharded
reference that accumulates the same micro-batches of the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.transport import comm, memory
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
MICRO = 2
STEPS = 3


def _run(rank: int, world: int, mapped: bool) -> dict[str, float]:
    if mapped:  # every CPU block a mapping of its own, as for units of 4 MiB and more
        memory._MIN_BYTES = 1
    out: dict[str, float] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for mode in ("sharded", "no_sync"):
            for precision in (None, flatshard.MixedPrecision(param_dtype=torch.bfloat16)):
                if precision is not None and (mode == "sharded" or strategy != "FULL_SHARD"):
                    continue
                case = f"{strategy}/{mode}/{'bf16' if precision else 'fp32'}"
                torch.manual_seed(0)
                reference = TinyGPT()
                model = copy.deepcopy(reference)
                flatshard.shard(
                    model, sharding_strategy=strategy, auto_wrap_policy={Block}, mixed_precision=precision
                )
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
                comm.comm_stats.clear()
                kept_bytes = 0
                for step in range(STEPS):
                    for micro in range(MICRO):
                        idx, tgt = make_batch(10 * step + micro, PER_RANK * world)
                        if precision is None:
                            (reference.loss(idx, tgt) / MICRO).backward()
                        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                        last = micro == MICRO - 1
                        with flatshard.no_sync(model, enabled=mode == "no_sync" and not last):
                            (model.loss(idx[mine], tgt[mine]) / MICRO).backward()
                        if not last:
                            kept_bytes = max(
                                kept_bytes,
                                sum(
                                    h._unsynced_grad.numel() * h._unsynced_grad.element_size()
                                    for s in unit_states(model)
                                    for h in s.handles
                                    if h._unsynced_grad is not None
                                ),
                            )
                    if precision is None:
                        ref_opt.step()
                        ref_opt.zero_grad()
                    opt.step()
                    opt.zero_grad()
                out[f"{case}/reduced_bytes"] = float(
                    comm.comm_stats["reduce_scatter"] + comm.comm_stats["all_reduce"]
                )
                out[f"{case}/kept_bytes"] = float(kept_bytes)
                if precision is None:
                    with flatshard.unshard_params(model):
                        out[case] = max(
                            (a - b).abs().max().item()
                            for a, b in zip(model.parameters(), reference.parameters())
                        )
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mapped", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["heap", "mapped"]
)
def test_accumulation_both_ways_matches_reference(mapped: bool) -> None:
    full_bytes = sum(p.numel() for p in TinyGPT().parameters()) * 4
    for r in spawn(_run, 2, mapped):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for mode in ("sharded", "no_sync"):
                assert r[f"{strategy}/{mode}/fp32"] <= 1e-5, (strategy, mode, r)
            sharded, unsynced = (
                r[f"{strategy}/sharded/fp32/reduced_bytes"],
                r[f"{strategy}/no_sync/fp32/reduced_bytes"],
            )
            assert unsynced * MICRO == pytest.approx(sharded, rel=0.01), (strategy, sharded, unsynced)
            assert r[f"{strategy}/sharded/fp32/kept_bytes"] == 0
            assert (
                r[f"{strategy}/no_sync/fp32/kept_bytes"] >= full_bytes
            )  # the whole model's gradient (padded)
        assert r["FULL_SHARD/no_sync/bf16/kept_bytes"] >= full_bytes  # kept in fp32, the gradient dtype


def test_no_sync_needs_a_sharded_module() -> None:
    with (
        pytest.raises(ValueError, match="no_sync needs a module sharded"),
        flatshard.no_sync(nn.Linear(2, 2)),
    ):
        pass
