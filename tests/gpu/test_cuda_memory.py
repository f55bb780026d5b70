"""Peak GPU memory of a FULL_SHARD step (``torch.cuda.max_memory_allocated``), against the unsharded model.

A stack of ``Linear(2048, 2048)`` units (16 MiB each) with a tiny batch, so parameters and gradients dominate.
Per rank and step, the sharded model holds its parameter shard and gains its gradient shard (1/world of the
model each); on top of that only a bounded number of units is ever unsharded at once (the one computing, a
prefetched one, its unsharded gradient, the reduction in flight), whatever the depth. So:

- after ``shard()``: the parameter shard and nothing else (padding aside);
- during a step: shard + gradient shard + at most ``UNITS_IN_FLIGHT`` units, with 16 and with 8 layers (the
  excess must not grow with depth);
- the whole step's peak well below the unsharded model's (parameters + gradients), and the same weights after it.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.testing import spawn

from .cuda_common import max_abs_diff, rank_device, ranks_and_backend, reference_params, sharded_params

pytestmark = pytest.mark.gpu

WIDTH = 2048
PER_RANK = 8
MIB = 2**20
# Unsharded units alive at once at most: the unit computing and the prefetched one, the unit's gradients
# (autograd's and the packed flat copy), the reduction in flight and its output, gloo's staging copy, slack.
UNITS_IN_FLIGHT = 8


class Stack(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()


def _settled(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    gc.collect()
    return torch.cuda.memory_allocated(device)


def _step_peak(
    model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, device: torch.device
) -> tuple[int, int]:
    """(allocated before, peak during) one forward, backward and SGD step."""
    start = _settled(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.loss(x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return start, torch.cuda.max_memory_allocated(device)


def _measure(rank: int, world: int, depth: int, with_reference: bool) -> dict[str, Any]:
    device = rank_device(rank)
    torch.manual_seed(0)
    cpu_model = Stack(depth)
    unit = sum(p.numel() * p.element_size() for p in cpu_model.layers[0].parameters())
    x = torch.randn(PER_RANK * world, WIDTH, generator=torch.Generator().manual_seed(3)).to(device)
    out: dict[str, Any] = {"unit": unit, "model": depth * unit}
    if with_reference:
        base = _settled(device)
        reference = copy.deepcopy(cpu_model).to(device)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        _, peak = _step_peak(reference, x, ref_opt, device)
        out["reference_total"] = peak - base
        expected = reference_params(reference)
        del reference, ref_opt
        torch.cuda.empty_cache()
    base = _settled(device)
    model = copy.deepcopy(cpu_model)
    flatshard.shard(model, auto_wrap_policy={nn.Linear}, device=device)
    out["after_shard"] = _settled(device) - base
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start, peak = _step_peak(model, x[rank * PER_RANK : (rank + 1) * PER_RANK], opt, device)
    out["total"] = peak - base
    out["excess"] = peak - start - out["model"] / world  # beyond the shard and the new gradient shard
    if with_reference:
        out["weights"] = max_abs_diff(sharded_params(model), expected)
    del model, opt
    torch.cuda.empty_cache()
    return out


def _run(rank: int, world: int) -> dict[str, Any]:
    return {"deep": _measure(rank, world, 16, True), "shallow": _measure(rank, world, 8, False)}


@pytest.mark.timeout(600)
def test_peak_memory_stays_within_bounds() -> None:
    world, backend = ranks_and_backend()
    for rank, r in enumerate(spawn(_run, world, backend=backend, timeout=600)):
        deep, shallow = r["deep"], r["shallow"]
        unit = deep["unit"]
        assert deep["weights"] < 1e-4, (rank, r)
        for m in (deep, shallow):
            assert m["after_shard"] <= m["model"] / world + MIB, (rank, m)  # the shard, plus padding
            assert m["excess"] <= UNITS_IN_FLIGHT * unit + 4 * MIB, (rank, m, m["excess"] / unit)
        assert deep["excess"] <= shallow["excess"] + unit, (rank, r)  # does not grow with depth
        # Unsharded: parameters + gradients = 2 models; sharded on 2 ranks about 1 model + a few units.
        assert deep["total"] <= 0.8 * deep["reference_total"], (rank, r)
