"""A fine-tuning schedule through the Trainer: a first ``fit`` with the blocks frozen (only the embeddings,
the final norm and the head train), then the blocks unfrozen and a second ``fit`` of the same module, on
2 ranks. flatshard matches DDP step for step, and the frozen blocks do not move in the first fit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import WEIGHT_TOL, LitGPT, LossRecorder, make_loader, make_trainer

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH = 3, 8


def _schedule(rank: int, world: int, strategy_name: str) -> dict[str, Any]:
    import flatshard

    torch.set_num_threads(1)
    module = LitGPT(seed=0)
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    for block in module.model.blocks:
        block.requires_grad_(False)
    losses = []
    for fit in range(2):
        if fit == 1:
            for block in module.model.blocks:
                block.requires_grad_(True)
        recorder = LossRecorder()
        strategy: Any = (
            flatshard.FlatShardStrategy(auto_wrap_policy={Block}) if strategy_name == "flatshard" else "ddp"
        )
        trainer = make_trainer(world, strategy, max_epochs=1, callbacks=[recorder])
        trainer.fit(module, make_loader(STEPS, GLOBAL_BATCH, world))
        losses += recorder.losses
        context = flatshard.unshard_params(module) if flatshard.is_sharded(module) else torch.no_grad()
        with context:
            state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        if fit == 0:
            moved = sorted(
                k for k in state if k.startswith("blocks.") and not torch.equal(state[k], initial[k])
            )
            assert not moved, moved  # frozen: untouched by the first fit
    return {"losses": losses, "state": state}


@pytest.mark.timeout(600)
def test_frozen_then_unfrozen_fits_match_ddp() -> None:
    ours = spawn(_schedule, 2, "flatshard")
    ddp = spawn(_schedule, 2, "ddp")
    for mine, theirs in zip(ours, ddp, strict=True):
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]), **WEIGHT_TOL)
        for key, expected in theirs["state"].items():
            torch.testing.assert_close(
                mine["state"][key], expected, **WEIGHT_TOL, msg=lambda m, key=key: f"{key}: {m}"
            )
