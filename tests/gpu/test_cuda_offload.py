"""CPU offload on CUDA (pinned CPU shards, the optimizer on CPU), against the unsharded model:

- ``unshard_params`` on an offloaded model: full parameters and gradients on the GPU or in CPU memory, writes
  kept (also from rank 0 alone) and used by the next step, shards still pinned afterwards;
- float16 mixed precision with offload, as ``precision="16-mixed"`` runs it (fp16 gathers, fp32 reduction,
  autocast, ``FlatShardGradScaler``), against an unsharded emulation doing the same arithmetic per rank slice
  (the method of ``benchmarks/gpu_check_worker.py``, here for FULL_SHARD and SHARD_GRAD_OP).
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from .cuda_common import max_abs_diff, rank_device, ranks_and_backend, reference_params, sharded_params

pytestmark = pytest.mark.gpu

PER_RANK = 2
LR = 0.1


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _offloaded_pair(rank: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.device]:
    device = rank_device(rank)
    torch.manual_seed(0)
    reference = TinyGPT().to(device)
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block}, cpu_offload=True, device=device)
    return reference, model, device


def _sgd_step(rank: int, world: int, model: torch.nn.Module, reference: torch.nn.Module, n: int) -> None:
    """One SGD step on both models; gradients are left in place."""
    device = next(reference.parameters()).device
    idx, tgt = (t.to(device) for t in make_batch(n, PER_RANK * world))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    reference.loss(idx, tgt).backward()
    model.loss(idx[mine], tgt[mine]).backward()
    for m in (model, reference):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)


def _zero_grads(*models: torch.nn.Module) -> None:
    for m in models:
        for p in m.parameters():
            p.grad = None


def _unshard_with_offload(rank: int, world: int) -> dict[str, Any]:
    reference, model, _ = _offloaded_pair(rank)
    out: dict[str, Any] = {}
    _sgd_step(rank, world, model, reference, 0)  # gradients stay: unshard_params(with_grads=True) shows them
    with flatshard.unshard_params(model, with_grads=True):
        out["gpu_devices"] = sorted({p.device.type for p in model.parameters()})
        out["gpu_params"] = max_abs_diff(reference_params(model), reference_params(reference))
        out["gpu_grads"] = max_abs_diff(_grads(model), _grads(reference))
    with flatshard.unshard_params(model, offload_to_cpu=True):
        out["cpu_devices"] = sorted({p.device.type for p in model.parameters()})
        out["cpu_params"] = max_abs_diff(reference_params(model), reference_params(reference))
    with torch.no_grad(), flatshard.unshard_params(model):  # writeback=True: every rank's change is kept
        for p in model.parameters():
            p.mul_(0.5)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    out["written"] = max_abs_diff(sharded_params(model), reference_params(reference))
    handles = [h for s in unit_states(model) for h in s.handles]
    out["pinned_after"] = all(h.sharded.is_pinned() for h in handles)
    out["param_devices_after"] = sorted({p.device.type for p in model.parameters()})
    _zero_grads(model, reference)
    _sgd_step(rank, world, model, reference, 1)  # the next gathers copy the written shards to the GPU
    out["after_step"] = max_abs_diff(sharded_params(model), reference_params(reference))
    return out


def _unshard_rank0_only_with_offload(rank: int, world: int) -> dict[str, Any]:
    """rank0_only writeback: rank 0's change is broadcast into every rank's pinned CPU shard."""
    reference, model, _ = _offloaded_pair(rank)
    _sgd_step(rank, world, model, reference, 0)
    _zero_grads(model, reference)
    with torch.no_grad():
        with flatshard.unshard_params(model, rank0_only=True):
            if rank == 0:
                for p in model.parameters():
                    p.add_(0.01)
        for p in reference.parameters():
            p.add_(0.01)
    out = {"written": max_abs_diff(sharded_params(model), reference_params(reference))}
    _sgd_step(rank, world, model, reference, 1)
    out["after_step"] = max_abs_diff(sharded_params(model), reference_params(reference))
    return out


WEIGHT_TOL, LOSS_TOL = 2e-3, 5e-3  # a float16 ulp per step at most: see benchmarks/gpu_check_worker.py
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2


def _fp16_offload(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Sharded 16-mixed with offload against the per-slice float16 emulation (fp32 masters on CPU)."""
    from flatshard.lightning.precision import FlatShardGradScaler

    device = rank_device(rank)
    torch.manual_seed(0)
    master = TinyGPT(n_layer=4)  # the reference's fp32 weights, on the CPU like the offloaded shards
    model = copy.deepcopy(master).to(device)
    mp = flatshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    flatshard.shard(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy={Block},
        cpu_offload=True,
        mixed_precision=mp,
        device=device,
    )
    pinned = all(h.sharded.is_pinned() for s in unit_states(model) for h in s.handles)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(master.parameters(), lr=LR)
    scaler = FlatShardGradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    ref_scaler.scale(torch.zeros(()))  # creates its scale tensor, as a first scale(loss) would
    worst_loss = 0.0
    for step in range(4):
        idx, tgt = (t.to(device) for t in make_batch(step, PER_RANK * world))
        scale, grads, ref_losses = ref_scaler.get_scale(), None, []
        for r in range(world):
            low = copy.deepcopy(master).to(device=device, dtype=torch.float16)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = low.loss(
                    idx[r * PER_RANK : (r + 1) * PER_RANK], tgt[r * PER_RANK : (r + 1) * PER_RANK]
                )
            (loss * scale).backward()
            ref_losses.append(loss.item())
            mine = [p.grad.float().cpu() for p in low.parameters()]
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
        for p, g in zip(master.parameters(), grads):
            p.grad = g / world
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)

        with torch.autocast(device.type, dtype=torch.float16):
            loss = model.loss(
                idx[rank * PER_RANK : (rank + 1) * PER_RANK], tgt[rank * PER_RANK : (rank + 1) * PER_RANK]
            )
        scaler.scale(loss).backward()
        assert all(p.grad.device.type == "cpu" for p in model.parameters() if p.grad is not None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        expected = sum(ref_losses) / world
        worst_loss = max(worst_loss, abs(total.item() / world - expected) / max(1.0, abs(expected)))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    weights = max(
        (full[k].float() - v).abs().max().item()
        for k, v in master.state_dict().items()
        if v.is_floating_point()
    )
    return {
        "loss": worst_loss,
        "weights": weights,
        "scale": scaler.get_scale(),
        "ref_scale": ref_scaler.get_scale(),
        "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "pinned": pinned,
    }


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    cases = {
        "unshard_params": lambda: _unshard_with_offload(rank, world),
        "unshard_rank0_only": lambda: _unshard_rank0_only_with_offload(rank, world),
        "fp16/FULL_SHARD": lambda: _fp16_offload(rank, world, "FULL_SHARD"),
        "fp16/SHARD_GRAD_OP": lambda: _fp16_offload(rank, world, "SHARD_GRAD_OP"),
    }
    for name, case in cases.items():
        try:
            results[name] = case()
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


@pytest.mark.timeout(600)
def test_unshard_params_with_offload(runs: list[dict[str, Any]]) -> None:
    for r in _case(runs, "unshard_params"):
        assert r["gpu_devices"] == ["cuda"] and r["cpu_devices"] == ["cpu"], r
        for key in ("gpu_params", "gpu_grads", "cpu_params", "written", "after_step"):
            assert r[key] < 1e-5, (key, r)
        assert r["pinned_after"] and r["param_devices_after"] == ["cpu"], r


@pytest.mark.timeout(600)
def test_unshard_params_rank0_only_writeback_with_offload(runs: list[dict[str, Any]]) -> None:
    for r in _case(runs, "unshard_rank0_only"):
        assert r["written"] < 1e-5 and r["after_step"] < 1e-5, r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_16_mixed_with_offload_matches_reference(runs: list[dict[str, Any]], strategy: str) -> None:
    for r in _case(runs, f"fp16/{strategy}"):
        assert r["loss"] <= LOSS_TOL and r["weights"] <= WEIGHT_TOL, r
        assert r["scale"] == r["ref_scale"], r
        assert r["shard_dtypes"] == ["torch.float32"], r  # fp32 masters; only gathers are float16
        assert r["pinned"], r
