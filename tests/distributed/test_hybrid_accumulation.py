"""Gradient accumulation under hybrid sharding reduces across replicas once per optimizer step (see [Note: replica
reductions once per step]): 4 gloo ranks as 2 "nodes" of 2, k = 4 micro-batches. Bytes are counted per process
group; weights are compared with the unsharded model trained on the same global batches."""

from __future__ import annotations

import copy
from collections.abc import Callable
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
MICRO = 4


def _accumulate_with(how: str, model: torch.nn.Module) -> Callable[[bool], Any]:
    """A context per micro-batch (``last``: the one that syncs) for each way a user accumulates."""
    import contextlib

    @contextlib.contextmanager
    def micro(last: bool) -> Any:
        if how == "every":  # each micro-batch reduces everywhere (sync on every backward)
            yield
        elif how == "no_sync":
            with flatshard.no_sync(model, enabled=not last):
                yield
        elif how == "all_reduce":  # what the Trainer's accumulate_grad_batches does in "sharded" mode
            flatshard.set_requires_all_reduce(model, last)
            yield
        elif how == "gradient_sync":
            flatshard.set_requires_gradient_sync(model, last)
            yield

    return micro


def _train(rank: int, world: int, how: str, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, sharding_strategy=strategy, auto_wrap_policy={Block}, shard_group_size=2)
    handle = unit_states(model)[0].handles[0]
    shard_state, replicate_state = (
        groups.state_of(handle.shard_group),
        groups.state_of(handle.replicate_group),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    micro = _accumulate_with(how, model)
    shard_state.sent.clear()
    replicate_state.sent.clear()
    peak_grad = 0
    for step in range(STEPS):
        for m in range(MICRO):
            idx, tgt = make_batch(step * MICRO + m, PER_RANK * world)
            (reference.loss(idx, tgt) / MICRO).backward()
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            with micro(last=m == MICRO - 1):
                (model.loss(idx[mine], tgt[mine]) / MICRO).backward()
            kept = sum(
                (h._replica_partial.numel() if h._replica_partial is not None else 0)
                + (h._unsynced_grad.numel() if h._unsynced_grad is not None else 0)
                for s in unit_states(model)
                for h in s.handles
            )
            peak_grad = max(peak_grad, kept)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    with flatshard.unshard_params(model):
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    shard_numel = sum(h.sharded.numel() for s in unit_states(model) for h in s.handles)
    return {
        "worst": worst,
        "shard": dict(shard_state.sent),
        "replicate": dict(replicate_state.sent),
        "kept": peak_grad,
        "shard_numel": shard_numel,
    }


def _cases(rank: int, world: int, strategy: str, ways: list[str]) -> dict[str, Any]:
    return {how: _train(rank, world, how, strategy) for how in ways}


def _check(results: list[dict[str, Any]], ways: list[str]) -> None:
    for rank, r in enumerate(results):
        every = r["every"]
        for how in ways:
            got = r[how]
            assert got["worst"] < 2e-5, (rank, how, got["worst"])
            if how == "every":
                continue
            # between nodes: one all-reduce of the gradient shard per optimizer step instead of one per micro-batch
            assert got["replicate"]["all_reduce"] * MICRO == every["replicate"]["all_reduce"], (
                rank,
                how,
                got,
            )
            # inside a node: every micro-batch still reduce-scatters, so gradient memory stays the shard's
            assert got["shard"]["reduce_scatter"] == every["shard"]["reduce_scatter"], (rank, how, got)
            assert 0 < got["kept"] <= got["shard_numel"], (rank, how, got)


@pytest.mark.timeout(600)
def test_hybrid_accumulation_reduces_across_replicas_once_per_step() -> None:
    ways = ["every", "no_sync", "all_reduce", "gradient_sync"]
    _check(spawn(_cases, 4, "HYBRID_SHARD", ways), ways)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hybrid_zero2_accumulation() -> None:
    ways = ["every", "no_sync", "all_reduce"]
    _check(spawn(_cases, 4, "HYBRID_SHARD_ZERO2", ways), ways)


def _recurse(rank: int, world: int) -> dict[str, Any]:
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    block = model.blocks[0]
    flatshard.set_requires_gradient_sync(block, False, recurse=False)
    flags = [h.sync_grads for s in unit_states(model) for h in s.handles]
    errors = []
    for target in (torch.nn.Linear(2, 2), model.blocks):  # not sharded; holds units but is none
        try:
            flatshard.set_requires_gradient_sync(target, False, recurse=False)
        except ValueError as e:
            errors.append(str(e))
    flatshard.set_requires_gradient_sync(model, True)
    return {
        "flags": flags,
        "errors": errors,
        "after": [h.sync_grads for s in unit_states(model) for h in s.handles],
    }


def test_per_unit_gradient_sync_and_its_errors() -> None:
    r = spawn(_recurse, 2)[0]
    assert r["flags"].count(False) == 1, r["flags"]  # only the block's own unit
    assert all(r["after"])
    assert len(r["errors"]) == 2 and all("HINT" in e for e in r["errors"]), r["errors"]
    assert "a unit itself (recurse=False)" in r["errors"][1]


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _TwoBranches(torch.nn.Module):
    """``b`` runs only in the micro-batches asked for: its partial sum is all-reduced alone on the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _Branch()
        self.b = _Branch()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.head(self.b(h) if use_b else h)


def _absent_in_last(rank: int, world: int) -> float:
    torch.manual_seed(0)
    reference = _TwoBranches()
    model = copy.deepcopy(reference)
    flatshard.shard(model, sharding_strategy="HYBRID_SHARD", shard_group_size=2, auto_wrap_policy={_Branch})
    opt, ref_opt = (
        torch.optim.SGD(model.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for m in range(MICRO):
            x = torch.randn(PER_RANK * world, 8, generator=g)
            use_b = m < MICRO - 1  # b takes no part in the micro-batch that syncs
            (reference(x, use_b).square().mean() / MICRO).backward()
            with flatshard.no_sync(model, enabled=m < MICRO - 1):
                (model(x[rank * PER_RANK : (rank + 1) * PER_RANK], use_b).square().mean() / MICRO).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    with flatshard.unshard_params(model):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def test_a_unit_absent_from_the_syncing_micro_batch_still_reduces_its_partial_sum() -> None:
    assert max(spawn(_absent_in_last, 4)) < 1e-6
