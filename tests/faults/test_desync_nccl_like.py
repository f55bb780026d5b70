"""The desync detector where collectives never block the host, as on NCCL (see [Note: finding a desync]).

The ranks train a sharded TinyGPT on the CUDA code path of the CPU fake (``tests/fake_streams.py`` with
``nccl_like=True``): the host never waits for a collective, and an event completes only once the collectives
issued before it did, so a rank whose gathers cannot complete blocks where it would on a GPU, in the
all-gather rate limiter. A rank that skipped a step is reported within the limit, waiting in the strategy's
barrier (published before a NCCL barrier blocks) or in torch's; a rank whose GPU is merely slow (the
limiter waits long on a gather every rank issued) never is, and trains as the unsharded reference does.
Gloo carries the data (``FLATSHARD_SHM=0``), so collectives have c10d numbers as on NCCL.
"""

from __future__ import annotations

import copy
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.transport import watchdog
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests import fake_streams
from tests.fake_streams import record_streams

pytestmark = pytest.mark.slow

LIMIT = 4.0  # seconds: the desync_timeout of these runs
GLOO = {"FLATSHARD_SHM": "0"}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    idx, tgt = make_batch(step, 2 * world)
    model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]).backward()
    opt.step()
    opt.zero_grad()


def _strategy_barrier_on_nccl() -> None:
    """The strategies' barrier as it runs on NCCL: the position is published, then ``wait`` blocks."""
    work = dist.barrier(async_op=True)
    with mock.patch.object(dist, "get_backend", lambda group=None: "nccl"):
        watchdog.wait_collective(work, "the strategy's barrier", op="barrier")


def _skips_a_step(rank: int, world: int, barrier: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, desync_timeout=LIMIT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world)  # an ordinary first step
    out: dict[str, Any] = {"error": None}
    started = time.monotonic()
    try:
        with record_streams(model, nccl_like=True):
            if rank == 1:  # skipped step 1: on to the end-of-epoch barrier
                _strategy_barrier_on_nccl() if barrier == "strategy" else dist.barrier()
            else:
                _step(model, opt, 1, rank, world)
    except RuntimeError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    out["seconds"] = time.monotonic() - started
    out["verdict"] = watchdog.verdict()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("barrier", ["strategy", "torch"])
def test_a_skipped_step_is_reported_where_collectives_never_block_the_host(barrier: str) -> None:
    waiting, skipped = spawn(_skips_a_step, 2, barrier, env=GLOO, timeout=120)
    error = waiting["error"]
    assert error is not None and error.startswith("DesyncError"), waiting
    assert waiting["seconds"] < LIMIT + 2.0, waiting  # reported within the limit (plus a beat)
    # the host blocked in the rate limiter, on a block's gather rank 1 never issued
    assert "rank 0 waits in all_gather" in error and "unit 'blocks." in error and "forward" in error, error
    if barrier == "strategy":
        assert "rank 1 waits in the strategy's barrier" in error, error
    else:
        assert "rank 1 is blocked in torch.distributed.barrier, called from" in error, error
    assert "HINT" in error, error
    assert skipped["verdict"] == error.removeprefix("DesyncError: "), skipped


def _slow_gpu(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's "GPU" takes 2.5 half-limits on one kernel in step 1: its limiter waits that long on a gather
    both ranks issued, while rank 0 waits for rank 1's next gather. Slow, not stuck: never reported."""
    torch.manual_seed(0)
    reference = TinyGPT()
    model = flatshard.shard(copy.deepcopy(reference), auto_wrap_policy={Block}, desync_timeout=LIMIT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    slow_until = [0.0]
    real_query, real_sync = fake_streams.FakeEvent.query, fake_streams.FakeEvent.synchronize

    def query(event: fake_streams.FakeEvent) -> bool:
        return time.monotonic() >= slow_until[0] and real_query(event)

    def synchronize(event: fake_streams.FakeEvent) -> None:
        time.sleep(max(0.0, slow_until[0] - time.monotonic()))
        real_sync(event)

    out: dict[str, Any] = {"error": None}
    try:
        with (
            record_streams(model),
            mock.patch.object(fake_streams.FakeEvent, "query", query),
            mock.patch.object(fake_streams.FakeEvent, "synchronize", synchronize),
        ):
            for step in range(3):
                if step == 1 and rank == 1:
                    slow_until[0] = time.monotonic() + 2.5 * LIMIT / 2
                _step(model, opt, step, rank, world)
                idx, tgt = make_batch(step, 2 * world)
                reference.loss(idx, tgt).backward()
                ref_opt.step()
                ref_opt.zero_grad()
    except RuntimeError as err:
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    out["verdict"] = watchdog.verdict()
    with flatshard.unshard_params(model):
        out["max_diff"] = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    return out


@pytest.mark.timeout(150)
def test_a_slow_gpu_is_never_reported_where_collectives_never_block_the_host() -> None:
    for rank, result in enumerate(spawn(_slow_gpu, 2, env=GLOO, timeout=120)):
        assert result["error"] is None, (rank, result)
        assert result["verdict"] is None, (rank, result)
        assert result["max_diff"] < 1e-5, (rank, result)
