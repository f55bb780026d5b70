"""Desyncs fail fast and name themselves (see [Note: finding a desync]): a rank that skipped a training step,
or ran another unit, makes every rank waiting in a flatshard collective raise ``DesyncError`` within the
``desync_timeout`` limit, with each rank's position; a slow rank is never reported, and trains as the unsharded
reference does. Both transports: shared memory (the default on one host) and gloo (``FLATSHARD_SHM=0``)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.transport import watchdog
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

LIMIT = 6.0  # seconds: the tests' desync_timeout
TRANSPORTS = [
    pytest.param({}, id="shm"),
    pytest.param({"FLATSHARD_SHM": "0"}, id="gloo", marks=pytest.mark.slow),
]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    idx, tgt = make_batch(step, 2 * world)
    loss = model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _skips_a_step(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, desync_timeout=LIMIT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"error": None}
    started = time.monotonic()
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                continue  # this rank skips a training step: one step behind from here on
            started = time.monotonic()
            _step(model, opt, step, rank, world)
        dist.barrier()  # the end-of-training barrier this rank reaches while rank 0 still gathers
    except RuntimeError as err:
        out["error"] = f"{type(err).__name__}: {err}"
        out["seconds"] = time.monotonic() - started
    out["verdict"] = watchdog.verdict()
    return out


@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_that_skips_a_training_step_makes_every_rank_raise_naming_positions(env: dict) -> None:
    waiting, barrier = spawn(_skips_a_step, 2, env=env, timeout=120)
    error = waiting["error"]
    assert error is not None and error.startswith("DesyncError"), waiting
    assert waiting["seconds"] < LIMIT, waiting  # reported within the limit
    assert "rank 0 waits in all_gather" in error and "unit '<root>', forward, step 3" in error, error
    assert "rank 1 is blocked in torch.distributed.barrier, called from" in error, error
    assert "test_desync.py" in error and "HINT" in error, error
    # rank 1 waited in a collective flatshard cannot interrupt: it knows the verdict, and its barrier
    # failed when rank 0 left
    assert barrier["verdict"] == error.removeprefix("DesyncError: "), barrier
    assert barrier["error"] is not None, barrier


class BranchyGPT(TinyGPT):
    """A data-dependent branch: block 1 runs on rank 0 only."""

    skip_block: bool = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for i, blk in enumerate(self.blocks):
            if not (self.skip_block and i == 1):
                h = blk(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]


def _runs_another_unit(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = BranchyGPT()
    model.skip_block = rank == 1
    flatshard.shard(model, auto_wrap_policy={Block}, desync_timeout=LIMIT)
    started = time.monotonic()
    try:
        _step(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, rank, world)
    except RuntimeError as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - started}
    return {"error": None}


@pytest.mark.parametrize("env", TRANSPORTS)
def test_ranks_running_different_units_raise_on_every_rank(env: dict) -> None:
    for rank, r in enumerate(spawn(_runs_another_unit, 2, env=env, timeout=120)):
        error = r["error"]
        assert error is not None and error.startswith("DesyncError"), (rank, r)
        assert r["seconds"] < LIMIT, (rank, r)
        # each rank's position is named: rank 0 still gathers in forward, rank 1 reduces in backward
        assert "rank 0" in error and "rank 1" in error and "HINT" in error, error
        assert "forward" in error and "backward" in error, error


def _slow_rank(rank: int, world: int, env_limit: float) -> dict:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = flatshard.shard(copy.deepcopy(ref), auto_wrap_policy={Block}, desync_timeout=env_limit)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        if rank == 1 and step == 1:
            time.sleep(2.5 * env_limit)  # a slow data loader, a long checkpoint write: not a desync
        losses.append(_step(model, opt, step, rank, world))
        ref.loss(*make_batch(step, 2 * world)).backward()  # the unsharded reference on the global batch
        ref_opt.step()
        ref_opt.zero_grad()
    with flatshard.unshard_params(model):
        same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(model.parameters(), ref.parameters()))
    return {"same": same, "verdict": watchdog.verdict(), "losses": losses}


@pytest.mark.slow
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_slow_rank_is_never_reported_and_trains_like_the_reference(env: dict) -> None:
    for rank, r in enumerate(spawn(_slow_rank, 2, 1.0, env=env, timeout=120)):
        assert r["verdict"] is None, (rank, r)
        assert r["same"], (rank, r)
