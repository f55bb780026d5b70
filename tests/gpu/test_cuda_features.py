"""Training features on CUDA, each against the unsharded model trained on the same global batches: forward
prefetch, BACKWARD_POST, activation checkpointing, ``no_sync`` accumulation and meta-device init.

Two ranks (see ``cuda_common``: one per GPU over NCCL, or both on GPU 0 over gloo). All cases run in one spawn
(CUDA start-up is paid once); each case's failure is reported on its own.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.activations import saved_activation_bytes
from flatshard.testing.models import Block, TinyGPT, make_batch

from .cuda_common import (
    init_eagerly,
    max_abs_diff,
    name_seeded_init,
    rank_device,
    ranks_and_backend,
    reference_params,
    sharded_params,
)

pytestmark = pytest.mark.gpu

PER_RANK = 2
STEPS = 3
LR = 0.1
TOL = 1e-4  # fp32 on both sides; only the batch split changes summation order


def _train(
    rank: int, world: int, model: nn.Module, reference: nn.Module, micro: int = 1, no_sync: bool = False
) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``micro`` micro-batches each on both models; loss and weight differences."""
    device = next(reference.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out: dict[str, Any] = {"loss": 0.0, "unsynced_devices": set()}
    for step in range(STEPS):
        for m in range(micro):
            idx, tgt = (t.to(device) for t in make_batch(10 * step + m, PER_RANK * world))
            ref_loss = reference.loss(idx, tgt) / micro
            ref_loss.backward()
            last = m == micro - 1
            with flatshard.no_sync(model, enabled=no_sync and not last):
                loss = model.loss(idx[mine], tgt[mine]) / micro
                loss.backward()
            if not last:
                out["unsynced_devices"] |= {
                    h._unsynced_grad.device.type
                    for s in unit_states(model)
                    for h in s.handles
                    if h._unsynced_grad is not None
                }
            total = loss.detach().clone()
            dist.all_reduce(total)
            out["loss"] = max(out["loss"], abs(total.item() / world - ref_loss.item()))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out["weights"] = max_abs_diff(sharded_params(model), reference_params(reference))
    out["unsynced_devices"] = sorted(out["unsynced_devices"])
    return out


def _pair(device: torch.device) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = TinyGPT().to(device)
    return reference, copy.deepcopy(reference)


def _forward_prefetch(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    reference, model = _pair(device)
    flatshard.shard(
        model,
        auto_wrap_policy={Block},
        forward_prefetch=True,
        backward_prefetch="BACKWARD_PRE",
        device=device,
    )
    return _train(rank, world, model, reference)


def _backward_post(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    reference, model = _pair(device)
    flatshard.shard(model, auto_wrap_policy={Block}, backward_prefetch="BACKWARD_POST", device=device)
    return _train(rank, world, model, reference)


def _activation_checkpointing(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    reference, model = _pair(device)
    plain = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, device=device)
    flatshard.shard(plain, auto_wrap_policy={Block}, device=device)
    idx, tgt = (t.to(device) for t in make_batch(99, PER_RANK))
    saved_ac, loss_ac = saved_activation_bytes(model, lambda: model.loss(idx, tgt))
    saved_plain, loss_plain = saved_activation_bytes(plain, lambda: plain.loss(idx, tgt))
    loss_ac.backward()
    loss_plain.backward()
    for m in (model, plain):
        for p in m.parameters():
            p.grad = None
    return {**_train(rank, world, model, reference), "saved_ac": saved_ac, "saved_plain": saved_plain}


def _no_sync(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    reference, model = _pair(device)
    flatshard.shard(model, auto_wrap_policy={Block}, device=device)
    return _train(rank, world, model, reference, micro=2, no_sync=True)


def _meta_init(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    reference = init_eagerly(TinyGPT()).to(device)
    with torch.device("meta"):
        model = TinyGPT()
    names = {m: n for n, m in model.named_modules()}
    flatshard.shard(model, auto_wrap_policy={Block}, param_init_fn=name_seeded_init(names), device=device)
    handles = [h for s in unit_states(model) for h in s.handles]
    out = {
        "tied": model.head.weight is model.wte.weight,
        "shard_devices": sorted({h.sharded.device.type for h in handles}),
        "buffer_device": model.steps.device.type,
        "meta_left": any(t.is_meta for t in (*model.parameters(), *model.buffers())),
        "init": max_abs_diff(sharded_params(model), reference_params(reference)),
    }
    return {**out, **_train(rank, world, model, reference)}


CASES: dict[str, Callable[[int, int, torch.device], dict[str, Any]]] = {
    "forward_prefetch": _forward_prefetch,
    "backward_post": _backward_post,
    "activation_checkpointing": _activation_checkpointing,
    "no_sync": _no_sync,
    "meta_init": _meta_init,
}


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    device = rank_device(rank)
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            results[name] = case(rank, world, device)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    world, backend = ranks_and_backend()
    return spawn(_all_cases, world, backend=backend, timeout=600)


def _case(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    per_rank = [r[name] for r in runs]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return per_rank


def _assert_parity(per_rank: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(per_rank):
        assert r["loss"] < TOL, (rank, r)
        assert r["weights"] < TOL, (rank, r)


@pytest.mark.timeout(600)
def test_forward_prefetch_matches_reference(runs: list[dict[str, Any]]) -> None:
    _assert_parity(_case(runs, "forward_prefetch"))


@pytest.mark.timeout(600)
def test_backward_post_matches_reference(runs: list[dict[str, Any]]) -> None:
    _assert_parity(_case(runs, "backward_post"))


@pytest.mark.timeout(600)
def test_activation_checkpointing_matches_reference_and_saves_less(runs: list[dict[str, Any]]) -> None:
    per_rank = _case(runs, "activation_checkpointing")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["saved_ac"] < 0.5 * r["saved_plain"], r  # a checkpointed block keeps only its input


@pytest.mark.timeout(600)
def test_no_sync_accumulation_on_gpu_matches_reference(runs: list[dict[str, Any]]) -> None:
    per_rank = _case(runs, "no_sync")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["unsynced_devices"] == ["cuda"], r  # the kept unsharded gradients live on the GPU


@pytest.mark.timeout(600)
def test_meta_device_init_on_cuda_matches_reference(runs: list[dict[str, Any]]) -> None:
    per_rank = _case(runs, "meta_init")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["tied"] and not r["meta_left"], r
        assert r["shard_devices"] == ["cuda"] and r["buffer_device"] == "cuda", r
        assert r["init"] == 0.0, r  # the same values as the eagerly built model
