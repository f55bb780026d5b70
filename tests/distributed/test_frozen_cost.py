"""Frozen parameters cost no gradient communication: a unit of large frozen weights and small adapters reduces
only its trainable extent (see [Note: reducing only what trains]), in every sharding strategy, with mixed
precision, offload, activation checkpointing and ``no_sync`` accumulation, on the shared-memory transport and
on gloo; and it trains like the unsharded model on the global batch.

The bound checked is the adapters' size: per step and unit, the gradient collectives send at most
``shard ranks x trainable elements`` (reduce-scatter) plus the trainable elements once more across replicas or
under ``NO_SHARD`` (all-reduce), in the reduce dtype. Before, every unit reduced its whole padded size.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.transport import comm
from flatshard.testing import spawn

from .test_frozen import LoRALinear as Adapted
from .test_frozen import LoRANet

D, R = 64, 2  # adapters are 6% of each unit


def _net(n: int = 3) -> nn.Module:
    return LoRANet(n, D, R)


CONFIGS: dict[str, dict[str, Any]] = {
    "full_shard_root": {},
    "full_shard_units": {"auto_wrap_policy": {Adapted}},
    "shard_grad_op": {"auto_wrap_policy": {Adapted}, "sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"auto_wrap_policy": {Adapted}, "sharding_strategy": "NO_SHARD"},
    "bf16": {
        "auto_wrap_policy": {Adapted},
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
    },
    "offload": {"auto_wrap_policy": {Adapted}, "cpu_offload": True},
    "checkpointed": {"auto_wrap_policy": {Adapted}, "activation_checkpointing_policy": {Adapted}},
    "no_sync": {"auto_wrap_policy": {Adapted}},
}
HYBRID = {
    "hybrid": {"auto_wrap_policy": {Adapted}, "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}
}


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def _train(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, options in configs.items():
        torch.manual_seed(0)
        reference = _net()
        model = copy.deepcopy(reference)
        flatshard.shard(model, **options)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        micro = 2 if name == "no_sync" else 1
        sent = []
        for step in range(3):
            x, y = _batch(step, 4 * world)
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            comm.comm_stats.clear()
            mine_x, mine_y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
            for m in range(micro):
                part = slice(4 // micro * m, 4 // micro * (m + 1))
                quiet = flatshard.no_sync(model) if m < micro - 1 else contextlib.nullcontext()
                with quiet:
                    (nn.functional.mse_loss(model(mine_x[part]), mine_y[part]) / micro).backward()
            sent.append(comm.comm_stats["reduce_scatter"] + comm.comm_stats["all_reduce"])
            opt.step()
            opt.zero_grad()
        handles = [h for s in unit_states(model) for h in s.handles]
        with flatshard.unshard_params(model):
            error = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
            )
        out[name] = {
            "error": error,
            "sent": max(sent),
            "trainable": [
                sum(n for n, p in zip(h.layout.numels, h.params) if p.requires_grad) for h in handles
            ],
            "whole": [h.layout.padded_numel for h in handles],
            "shard_world": handles[0].shard_world,
            "replicate_world": handles[0].replicate_world,
            "itemsize": handles[0].precision.reduce.itemsize,
        }
    return out


def _check(results: list[dict[str, dict[str, Any]]], configs: dict[str, dict[str, Any]]) -> None:
    for r in results:
        for name in configs:
            c = r[name]
            tolerance = 2e-2 if name == "bf16" else 1e-5
            assert c["error"] <= tolerance, (name, c)
            shard, replicas = c["shard_world"], c["replicate_world"]
            all_reduced = 1 if shard == 1 or replicas > 1 else 0
            bound = sum((shard + all_reduced) * t for t in c["trainable"]) * c["itemsize"]
            whole = sum(c["whole"]) * c["itemsize"]
            assert 0 < c["sent"] <= bound, (name, c["sent"], bound)
            assert c["sent"] * 5 < whole, (name, c["sent"], whole)  # frozen: 94% of each unit


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "transport", [{}, pytest.param({"FLATSHARD_SHM": "0"}, marks=pytest.mark.slow)], ids=["shm", "gloo"]
)
def test_frozen_weights_are_not_reduced(transport: dict[str, str]) -> None:
    _check(spawn(_train, 2, CONFIGS, env=transport), CONFIGS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_frozen_weights_are_not_reduced_hybrid() -> None:
    _check(spawn(_train, 4, HYBRID), HYBRID)


def _most_gathered_in_backward(rank: int, world: int, frozen_inputs: bool, chain: bool) -> dict[str, int]:
    """The most units gathered at once during backward, for adapters in every unit and for a first unit that
    is all frozen (its input needs no gradient); ``chain``: each unit's output is the next one's input (a stack
    of blocks), else an activation lies between them."""
    from flatshard.engine.handle import FlatParamHandle, HandleState

    torch.manual_seed(0)
    model = LoRANet(6, D, R)
    if chain:
        model.layers = nn.Sequential(*[Adapted(D, R) for _ in range(6)])
    if frozen_inputs:
        model.layers[0].requires_grad_(False)
    flatshard.shard(model, auto_wrap_policy={Adapted})
    handles = [h for s in unit_states(model) for h in s.handles]
    most = {"forward": 0, "backward": 0}
    phase = ["forward"]
    real = FlatParamHandle.unshard

    def counting(self: FlatParamHandle, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        gathered = sum(h.state is HandleState.UNSHARDED for h in handles)
        most[phase[0]] = max(most[phase[0]], gathered)

    FlatParamHandle.unshard = counting  # type: ignore[method-assign]
    try:
        for step in range(2):
            x, y = _batch(step, 4)
            phase[0] = "forward"
            loss = nn.functional.mse_loss(model(x), y)
            phase[0] = "backward"
            loss.backward()
            assert all(h.state is HandleState.SHARDED for h in handles[1:])  # every unit but the root
    finally:
        FlatParamHandle.unshard = real  # type: ignore[method-assign]
    return most


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "chain", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["activations_between", "chained"]
)
@pytest.mark.parametrize(
    "frozen_inputs",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["adapters", "frozen_first_unit"],
)
def test_units_with_frozen_parameters_free_them_during_backward(frozen_inputs: bool, chain: bool) -> None:
    """Each unit reshards once its backward is done (see [Note: when a unit with frozen parameters is
    done]), before the unit it hands over to prefetches the next (see [Note: handing over]), so backward holds
    the unit and the prefetched one, as a fully trainable model does, not the whole model: before, every unit
    stayed gathered until the end of backward, and a chained unit was freed one gather late."""
    for r in spawn(_most_gathered_in_backward, 2, frozen_inputs, chain):
        assert r["backward"] <= 2, r  # of 7 units (the root holds no parameter here)


class _Twice(nn.Module):
    """One adapted unit called twice in a forward, between two others: its backward spans two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.last = LoRANet(1, D, R), LoRANet(1, D, R), LoRANet(1, D, R)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.shared(torch.tanh(self.shared(self.first(x)))))


def _train_twice(rank: int, world: int) -> float:
    torch.manual_seed(0)
    reference = _Twice()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={LoRANet})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        x, y = _batch(step, 4 * world)
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(4 * rank, 4 * rank + 4)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    with flatshard.unshard_params(model):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.timeout(300)
def test_a_unit_called_twice_keeps_its_parameters_for_both_backwards() -> None:
    assert all(error <= 1e-5 for error in spawn(_train_twice, 2))
