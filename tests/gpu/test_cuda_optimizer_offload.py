"""``cpu_offload="optimizer"`` on CUDA (see [Note: optimizer offload]): shards, gradients and parameters stay on the
GPU, the optimizer state and its step live in CPU memory, the host copies are pinned, training matches the run
without offload and the unsharded model, and a load lands in host memory without passing through the GPU.

The CUDA stream ordering of the copies is checked on CPU by ``tests/distributed/test_optimizer_offload_streams.py``;
here the real streams run.
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
STEPS = 3


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **{kind: True})


def _train(rank: int, world: int, model: torch.nn.Module, opt: torch.optim.Optimizer, sharded: bool) -> None:
    device = next(model.parameters()).device
    for step in range(STEPS):
        idx, tgt = (t.to(device) for t in make_batch(step, PER_RANK * world))
        if sharded:
            idx, tgt = (
                idx[rank * PER_RANK : (rank + 1) * PER_RANK],
                tgt[rank * PER_RANK : (rank + 1) * PER_RANK],
            )
        model.loss(idx, tgt).backward()
        if sharded:
            flatshard.clip_grad_norm_(model, 0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _placement(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    handles = [h for s in unit_states(model) for h in s.handles]
    hosts = [h.host for h in handles if h.host is not None and h.host.params is not None]
    return {
        "param_devices": sorted({p.device.type for p in model.parameters()}),
        "shard_devices": sorted({h.sharded.device.type for h in handles}),
        "state_devices": sorted(
            {v.device.type for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
        ),
        "pinned": bool(hosts) and all(h.params.is_pinned() and h.grads.is_pinned() for h in hosts),
    }


def _parity(rank: int, world: int, kind: str, mixed: bool) -> dict[str, Any]:
    device = rank_device(rank)
    torch.manual_seed(0)
    reference = TinyGPT().to(device)
    out: dict[str, Any] = {}
    runs = {}
    for offload in ("optimizer", False):
        model = copy.deepcopy(reference)
        mp = {"mixed_precision": {"param_dtype": torch.bfloat16}} if mixed else {}
        flatshard.shard(model, auto_wrap_policy={Block}, cpu_offload=offload, device=device, **mp)
        opt = _optimizer(model, kind)
        _train(rank, world, model, opt, sharded=True)
        runs[offload] = sharded_params(model)
        if offload:
            out.update(_placement(model, opt))
    out["vs_plain"] = max_abs_diff(runs["optimizer"], runs[False])
    if not mixed:
        ref_opt = _optimizer(reference, kind)
        _train(rank, world, reference, ref_opt, sharded=False)
        out["vs_reference"] = max_abs_diff(runs["optimizer"], reference_params(reference))
    return out


def _load_to_host(rank: int, world: int) -> dict[str, Any]:
    """A load (flatshard's, and torch's own once flatshard saw the optimizer) never holds the state on the GPU."""
    device = rank_device(rank)
    torch.manual_seed(0)
    model = flatshard.shard(TinyGPT(d_model=64).to(device), auto_wrap_policy={Block}, cpu_offload="optimizer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(rank, world, model, opt, sharded=True)
    state, optim = flatshard.get_state_dict(model, opt, full=False)
    local = copy.deepcopy(opt.state_dict())
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    twin = flatshard.shard(TinyGPT(d_model=64).to(device), auto_wrap_policy={Block}, cpu_offload="optimizer")
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    out: dict[str, Any] = {"state_bytes": state_bytes}
    for how in ("set_state_dict", "torch"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        if how == "set_state_dict":
            flatshard.set_state_dict(twin, twin_opt, state, optim, full=False)
        else:
            twin_opt.load_state_dict(copy.deepcopy(local))
        out[f"{how}/peak_growth"] = torch.cuda.max_memory_allocated(device) - before
        out[f"{how}/placement"] = _placement(twin, twin_opt)
    _train(rank, world, model, opt, sharded=True)
    _train(rank, world, twin, twin_opt, sharded=True)
    out["resumed"] = max_abs_diff(sharded_params(model), sharded_params(twin))
    return out


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    cases = {
        "fused": lambda: _parity(rank, world, "fused", False),
        "foreach": lambda: _parity(rank, world, "foreach", False),
        "sgd": lambda: _parity(rank, world, "sgd", False),
        "fused_bf16": lambda: _parity(rank, world, "fused", True),
        "load": lambda: _load_to_host(rank, world),
    }
    results: dict[str, Any] = {}
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
@pytest.mark.parametrize("name", ["fused", "foreach", "sgd", "fused_bf16"])
def test_state_on_host_params_on_gpu_and_parity(runs: list[dict[str, Any]], name: str) -> None:
    for r in _case(runs, name):
        assert r["param_devices"] == ["cuda"] and r["shard_devices"] == ["cuda"], r
        assert r["state_devices"] == ["cpu"] and r["pinned"], r
        assert r["vs_plain"] <= 1e-5, r  # the CPU kernels against the CUDA ones
        if "vs_reference" in r:
            assert r["vs_reference"] <= 1e-5, r


@pytest.mark.timeout(600)
def test_load_goes_to_host_memory(runs: list[dict[str, Any]]) -> None:
    for r in _case(runs, "load"):
        for how in ("set_state_dict", "torch"):
            assert r[f"{how}/placement"]["state_devices"] == ["cpu"], (how, r)
            assert r[f"{how}/placement"]["param_devices"] == ["cuda"], (how, r)
            assert r[f"{how}/peak_growth"] < r["state_bytes"] / 2, (how, r)
        assert r["resumed"] <= 1e-6, r
