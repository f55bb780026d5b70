"""Float8 training on CUDA (see [Note: float8 all-gathers]): torchao's ``Float8Linear`` with float8 all-gathers
under bf16 mixed precision, eager and with each block compiled by inductor, against torchao's unsharded model
under DDP (per-rank batches, averaged gradients); the unit's linears see float8 weights, the gathers move one byte
per weight element, and compiled blocks break no graph.

Two ranks (see ``cuda_common``: one per GPU over NCCL, or both on GPU 0 over gloo). On a GPU without float8
tensor cores (before compute capability 8.9) the test is skipped.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard.engine.transport import comm
from flatshard.testing import spawn

from .cuda_common import rank_device, ranks_and_backend

pytestmark = pytest.mark.gpu

STEPS = 3
DIM = 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(device: torch.device) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(3))).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def _train(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    from flatshard.testing.dynamo import watch_dynamo

    device = rank_device(rank)
    with watch_dynamo() as watch:
        model = _model(device)
        reference = copy.deepcopy(model)
        flatshard.shard(model, auto_wrap_policy={Block}, device=device)
        if compiled:
            model.compile()
            reference.compile()
        seen: list[str] = []
        model[0].up.register_forward_pre_hook(
            lambda m, _: seen.append(str(getattr(m.weight, "_data", m.weight).dtype))
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        diff = 0.0
        for step in range(STEPS):
            x = torch.randn(
                8, 128, DIM, device=device, generator=torch.Generator(device).manual_seed(step * world + rank)
            )
            comm.comm_stats.clear()
            loss = model(x).float().square().mean()
            loss.backward()
            gathered = comm.comm_stats["all_gather"]
            opt.step()
            opt.zero_grad()
            ref_loss = reference(x).float().square().mean()
            ref_loss.backward()
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            ref_opt.step()
            ref_opt.zero_grad()
            diff = max(diff, abs(loss.item() - ref_loss.item()))
            watch.step()
    return {"loss": diff, "seen": sorted(set(seen)), "gathered": gathered, **watch.summary()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_cuda_float8_matches_torchao_under_ddp(compiled: bool) -> None:
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or newer")
    world, backend = ranks_and_backend()
    weights = 3 * 2 * 4 * DIM * DIM  # float8 bytes of all linears, gathered in forward and again in backward
    for rank, r in enumerate(spawn(_train, world, compiled, backend=backend)):
        where = f"rank {rank}: {r}"
        assert r["seen"] == ["torch.float8_e4m3fn"], where
        assert r["gathered"] < 2 * weights, where  # norms in fp32 are small; fp32 weights would be 4x
        assert r["loss"] < (2e-2 if compiled else 1e-5), where
        assert r["breaks"] == {}, where
        assert len(set(r["graphs"])) == 1, where
