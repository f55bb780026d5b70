"""A training loader that gives the ranks different numbers of batches (``use_distributed_sampler=False`` and a
hand-made split) leaves one rank gathering a unit for a step the other never runs. Through the Trainer the
waiting rank raises within ``desync_timeout``, naming where it waits: a ``DesyncError`` naming both ranks'
positions when the other rank waits in a collective of its own (an epoch-end metric reduction), or, when the
other rank's run ends and its process exits, an error saying so. Nothing hangs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import flatshard
from flatshard.engine.transport import watchdog
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, make_dataset, make_trainer

pytestmark = pytest.mark.slow

LIMIT = 8.0
BATCHES = (3, 2)  # training batches of rank 0 and rank 1


class LitEpochMetric(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, sync_dist=True, on_step=False, on_epoch=True)  # reduced at epoch end
        return loss


def _run(rank: int, world: int, epoch_metric: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    dataset = make_dataset(4, 4)  # 16 samples
    mine = torch.utils.data.Subset(dataset, range(8 * rank, 8 * rank + 2 * BATCHES[rank]))
    strategy = flatshard.FlatShardStrategy(auto_wrap_policy={Block}, desync_timeout=LIMIT)
    trainer = make_trainer(world, strategy, max_epochs=1, use_distributed_sampler=False)
    started = time.monotonic()
    try:
        trainer.fit((LitEpochMetric if epoch_metric else LitGPT)(), DataLoader(mine, batch_size=2))
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        return {"error": error, "seconds": time.monotonic() - started, "verdict": watchdog.verdict()}
    return {"error": None, "seconds": time.monotonic() - started, "verdict": watchdog.verdict()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("epoch_metric", [True, False], ids=["epoch_end_reduction", "exits"])
def test_uneven_training_batches_raise_naming_positions(epoch_metric: bool) -> None:
    results = spawn(_run, 2, epoch_metric, timeout=200)
    assert results[0]["error"] is not None, results  # rank 0, one step ahead, never finishes quietly
    assert all(r["seconds"] < LIMIT + 10 for r in results), results  # nobody hangs
    errors = [r["error"] or "" for r in results]
    if epoch_metric:
        assert all(errors), results
        # rank 1 waits in its epoch-end reduction while rank 0 starts step 3: a desync naming both ranks,
        # raised where flatshard waits (rank 1's reduction, or rank 0's all-gather) and known on both ranks
        desync = [e for e in errors if e.startswith("DesyncError")]
        assert desync, errors
        report = desync[0]
        assert "rank 1 waits in the barrier before a logged value's reduction" in report, report
        assert "rank 0 " in report and "HINT" in report, report
        # every rank knows the desync and both positions (under load a rank may hold a report made a beat
        # later, whose waiting times differ)
        for r in results:
            verdict = r["verdict"] or ""
            assert "rank 1 waits in the barrier before a logged value's reduction" in verdict, results
            assert "rank 0 " in verdict and "HINT" in verdict, results
    else:  # rank 1 finished its two batches and its process exited while rank 0 gathers for step 3
        assert "unit '<root>', forward, step 3" in errors[0], errors[0]
        assert "rank 1" in errors[0] and "exited while this rank waited for it" in errors[0], errors[0]
