"""CPU offload on 2 ranks: shards, gradient shards and optimizer state on CPU, each gather staged through a
copy on the compute device (a CPU-to-CPU copy here, the same code path as host-to-GPU), parity with the
unsharded model; state dicts, unshard_params with gradients and clipping still work."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2


def _run(rank: int, world: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        torch.manual_seed(0)
        reference = TinyGPT()
        model = copy.deepcopy(reference)
        flatshard.shard(
            model,
            sharding_strategy=strategy,
            auto_wrap_policy={Block},
            cpu_offload=flatshard.CPUOffload(True),
        )
        assert all(h.offload for s in unit_states(model) for h in s.handles)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(3):
            idx, tgt = make_batch(step, PER_RANK * world)
            reference.loss(idx, tgt).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            model.loss(idx[mine], tgt[mine]).backward()
            flatshard.clip_grad_norm_(model, 0.5)
            if step == 2:
                with flatshard.unshard_params(model, with_grads=True):
                    out[f"{strategy}/grads"] = max(
                        (a.grad - b.grad).abs().max().item()
                        for a, b in zip(model.parameters(), reference.parameters())
                    )
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        full, optim = flatshard.get_state_dict(model, opt, rank0_only=False)
        out[strategy] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        ref_state = ref_opt.state_dict()["state"]
        out[f"{strategy}/optim"] = max(
            (optim["state"][i]["exp_avg"] - ref_state[i]["exp_avg"]).abs().max().item() for i in ref_state
        )
    return out


@pytest.mark.timeout(300)
def test_cpu_offload_parity() -> None:
    for r in spawn(_run, 2):
        for key, value in r.items():
            assert value <= 1e-5, (key, r)


def test_cpu_offload_argument_validation() -> None:
    with pytest.raises(ValueError, match="cpu_offload='yes' is not an offload mode"):
        flatshard.shard(TinyGPT(), cpu_offload="yes")
    with pytest.raises(TypeError, match="cpu_offload must be a bool, 'optimizer'"):
        flatshard.shard(TinyGPT(), cpu_offload=1)  # type: ignore[arg-type]
    model = flatshard.shard(TinyGPT(), cpu_offload=True)
    assert unit_states(model)[0].handles[0].offload
