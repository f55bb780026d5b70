"""Forward inside ``flatshard.unshard_params``: the full parameters, no collectives, on every rank or rank 0
alone; backward refused; edits written back. Compared with the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.engine.transport import comm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _case(rank: int, world: int, options: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    flatshard.shard(model, auto_wrap_policy={Block}, **options)
    idx = make_batch(0, 4)[0]
    out: dict = {}
    with torch.no_grad():
        expected = ref(idx)
    # all ranks: forward on the full parameters, without a collective
    with flatshard.unshard_params(model, writeback=False, offload_to_cpu=options.get("cpu_offload", False)):
        comm.comm_stats.clear()
        with torch.no_grad():
            out["all_ranks"] = torch.allclose(model(idx), expected, atol=1e-5)
        logits = model(idx)  # grad enabled: the forward runs, a backward is refused
        out["no_collectives"] = sum(comm.comm_stats.values()) == 0
        try:
            logits.sum().backward()
            out["backward_refused"] = False
        except RuntimeError as err:
            out["backward_refused"] = "unshard_params" in str(err) and "HINT" in str(err)
    # rank 0 alone: the others hold their shards and are told so if they try
    with flatshard.unshard_params(model, rank0_only=True, writeback=False):
        if rank == 0:
            with torch.no_grad():
                out["rank0_alone"] = torch.allclose(model(idx), expected, atol=1e-5)
        elif options.get("sharding_strategy") != "NO_SHARD":
            try:
                model(idx)
                out["others_refused"] = False
            except RuntimeError as err:
                out["others_refused"] = "rank0_only" in str(err)
    # edits made inside are what the forward inside sees, and (writeback) what training continues from
    with flatshard.unshard_params(model, writeback=True):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
            out["sees_edits"] = torch.allclose(model(idx), _scaled(ref)(idx), atol=1e-5)
    with torch.no_grad():
        out["written_back"] = torch.allclose(model(idx), _scaled(ref)(idx), atol=1e-5)
    model.loss(*make_batch(1, 2)).backward()
    out["trains_after"] = all(p.grad is not None for p in model.parameters())
    return out


def _scaled(ref: TinyGPT) -> TinyGPT:
    scaled = copy.deepcopy(ref)
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(0.5)
    return scaled


@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, {"sharding_strategy": "FULL_SHARD"}),
        pytest.param(3, {"sharding_strategy": "SHARD_GRAD_OP"}, marks=pytest.mark.slow),
        pytest.param(2, {"sharding_strategy": "NO_SHARD"}, marks=pytest.mark.slow),
        pytest.param(2, {"sharding_strategy": "FULL_SHARD", "cpu_offload": True}, marks=pytest.mark.slow),
        pytest.param(4, {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}, marks=pytest.mark.slow),
    ],
    ids=["full_shard", "shard_grad_op", "no_shard", "offload", "hybrid"],
)
def test_forward_inside_unshard_params(world: int, options: dict) -> None:
    for rank, result in enumerate(spawn(_case, world, options)):
        assert result and all(result.values()), (rank, result)


def test_forward_inside_unshard_params_in_one_process() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = flatshard.shard(copy.deepcopy(ref), auto_wrap_policy={Block})
    idx = make_batch(0, 2)[0]
    with flatshard.unshard_params(model), torch.no_grad():
        assert torch.allclose(model(idx), ref(idx), atol=1e-6)
