"""The shared-memory transport between real ranks: chosen when it can be, the same training as gloo,
and every rank falls back together when one cannot use it."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.shard import unit_states
from flatshard.engine.transport import comm, shm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.matrices import WORLD_AND_STRATEGY

from ._sabotage import fail_segments

pytestmark = pytest.mark.skipif(shm._futex() is None, reason="the transport needs Linux x86-64")

STEPS = 3
PER_RANK = 2


def _train(model: torch.nn.Module, rank: int, world: int, local: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step, PER_RANK * world)
        if not local:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _count_packs(model: torch.nn.Module) -> list[int]:
    """A one-element list counting the model's packed flat gradients (``FlatParamHandle.pack_grads``)."""
    count = [0]
    for state in unit_states(model):
        for handle in state.handles:
            original = handle.pack_grads

            def counted(grads: Any, original: Any = original) -> torch.Tensor:
                count[0] += 1
                return original(grads)

            handle.pack_grads = counted  # type: ignore[method-assign]
    return count


def _run_both_transports(rank: int, world: int, strategy: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = TinyGPT(n_layer=2)
    everyone = list(range(world))
    shm_pg = dist.new_group(everyone, backend="gloo")
    gloo_pg = dist.new_group(everyone, backend="gloo")
    # The transport is chosen when a group is first used (collectively): set both up here.
    slots_pg = dist.new_group(everyone, backend="gloo")
    assert shm.shm_group(shm_pg) is not None
    os.environ["FLATSHARD_SHM"] = "0"
    assert shm.shm_group(gloo_pg) is None
    del os.environ["FLATSHARD_SHM"]
    slots = shm.shm_group(slots_pg, direct=False)  # all-gathers through the slots, not reading peers directly
    assert slots is not None and not slots.direct
    models = {
        name: flatshard.shard(
            copy.deepcopy(reference), sharding_strategy=strategy, auto_wrap_policy={Block}, process_group=pg
        )
        for name, pg in (("shm", shm_pg), ("slots", slots_pg), ("gloo", gloo_pg))
    }
    packed = {name: _count_packs(m) for name, m in models.items()}
    losses = {name: _train(m, rank, world, local=False) for name, m in models.items()}
    # Over shared memory a sharded unit's gradient is reduce-scattered from autograd's own tensors; gloo
    # needs it packed into one flat buffer, and so does NO_SHARD (the packed buffer is the gradient).
    assert packed["gloo"] == [STEPS * (1 + 2)], packed  # the root and two blocks, every step
    assert packed["shm"] == packed["slots"] == [0 if strategy != "NO_SHARD" else STEPS * 3]
    ref_losses = _train(reference, rank, world, local=True)
    torch.testing.assert_close(losses["shm"], losses["gloo"], rtol=1e-6, atol=1e-6)
    assert losses["shm"] == losses["slots"]  # the same bytes, moved two ways
    mean = torch.tensor(losses["shm"])
    dist.all_reduce(mean)  # the global batch's loss: the mean of equal-sized local batches
    torch.testing.assert_close((mean / world).tolist(), ref_losses, rtol=1e-5, atol=1e-5)
    with flatshard.unshard_params(models["shm"]), flatshard.unshard_params(models["gloo"]):
        for (name, a), b, c in zip(
            models["shm"].named_parameters(), models["gloo"].parameters(), reference.parameters(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(("world", "strategy"), WORLD_AND_STRATEGY)
def test_training_over_shared_memory_equals_gloo_and_the_unsharded_model(world: int, strategy: str) -> None:
    spawn(_run_both_transports, world, strategy)


def _run_fallback(rank: int, world: int, sabotage: str) -> bool:
    torch.set_num_threads(1)
    if sabotage == "cannot_create" and rank == 1:
        fail_segments(creating=True)
    if sabotage == "cannot_map" and rank == 0:
        fail_segments(creating=False)
    shard = torch.full((5,), float(rank))
    out = torch.empty(5 * world)
    comm.all_gather_flat(out, shard, None).wait()
    assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(5))
    left = [f for f in os.listdir("/dev/shm") if f.startswith("flatshard-comm-")]
    assert not left, left  # the names are unlinked once every peer mapped them (or gave up)
    return shm.shm_group(None) is not None


@pytest.mark.parametrize("sabotage", ["", "cannot_create", "cannot_map"])
def test_every_rank_falls_back_to_gloo_together(sabotage: str) -> None:
    used = spawn(_run_fallback, 3, sabotage)
    assert used == [not sabotage] * 3


def _direct_reads(rank: int, world: int, refuse: int | None) -> bool:
    """Whether the group reads peers directly, when rank ``refuse`` cannot; an all-gather is right either way."""
    torch.set_num_threads(1)
    group = shm.shm_group(None, direct=rank != refuse)
    assert group is not None
    for n in (5, (3 << 20) + 7):  # less than a slot, more than one
        shard = torch.arange(n, dtype=torch.float32) + rank * n
        out = torch.empty(n * world)
        comm.all_gather_flat(out, shard, None).wait()
        assert torch.equal(out, torch.arange(n * world, dtype=torch.float32))
    return group.direct


@pytest.mark.parametrize("refuse", [None, 1], ids=["all_can", "one_cannot"])
def test_the_ranks_agree_on_reading_each_other_directly(refuse: int | None) -> None:
    """See [Note: reading peers directly]: the ranks read each other's parts in place where every rank can, and
    all copy through the slots where one cannot; the results are the same."""
    direct = spawn(_direct_reads, 3, refuse)
    assert len(set(direct)) == 1, direct
    if refuse is not None:
        assert direct == [False] * 3
    elif shm._process_vm_readv() is not None and not os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        assert direct == [True] * 3  # nothing forbids it on this system
