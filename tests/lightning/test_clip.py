"""Gradient clipping through the Trainer: flatshard on 2 ranks matches DDP on 2 ranks.

SGD (not AdamW) on purpose: Adam's update is nearly invariant to a rescaling of the gradient, which would hide
a clipping coefficient computed from the local shard instead of the global norm. With SGD at lr 1 and a
clip value far below the gradient norm, clipping decides every update; the unclipped run shows it mattered.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from flatshard.testing import spawn

from .lit_common import LitGPT, assert_same_weights, load_ckpt, make_loader, make_trainer, strategy_by_name

pytestmark = pytest.mark.slow

STEPS = 3
CLIP = 0.05


RUNS = [  # (strategy, gradient_clip_algorithm or None for no clipping)
    ("ddp", None),
    ("ddp", "norm"),
    ("ddp", "value"),
    ("flatshard", "norm"),
    ("flatshard_block", "norm"),
    ("flatshard_grad_op", "norm"),
    ("flatshard", "value"),
    ("flatshard_block", "value"),
]


def _train(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every run writes its checkpoint; flatshard runs also report their last (clipped) gradients' size."""
    final_grads: dict[str, dict[str, float]] = {}
    for name, algorithm in RUNS:
        clip = {} if algorithm is None else {"gradient_clip_val": CLIP, "gradient_clip_algorithm": algorithm}
        model = LitGPT(optimizer="sgd", lr=1.0)
        trainer = make_trainer(world, strategy_by_name(name), max_epochs=1, **clip)
        trainer.fit(model, make_loader(STEPS, 2 * world, world))
        trainer.save_checkpoint(os.path.join(out_dir, f"{name}_{algorithm}.ckpt"))
        if name != "ddp":
            # The gradients of the last step stay on the parameters (disjoint shards): their global size.
            grads = [p.grad.detach() for p in model.parameters() if p.grad is not None and p.grad.numel()]
            square_sum = torch.stack([g.pow(2).sum() for g in grads]).sum()
            largest = torch.stack([g.abs().max() for g in grads]).max()
            torch.distributed.all_reduce(square_sum)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            final_grads[f"{name}_{algorithm}"] = {"norm": square_sum.sqrt().item(), "max": largest.item()}
    return final_grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("clip")
    ranks = spawn(_train, 2, str(directory))
    return {
        "weights": {f"{n}_{a}": load_ckpt(directory / f"{n}_{a}.ckpt")["state_dict"] for n, a in RUNS},
        "final_grads": ranks,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_matters_for_this_setup(algorithm: str, runs: dict[str, Any]) -> None:
    clipped, unclipped = runs["weights"][f"ddp_{algorithm}"], runs["weights"]["ddp_None"]
    largest = max((clipped[k] - unclipped[k]).abs().max().item() for k in clipped if k != "model.steps")
    assert largest > 1e-2, largest


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, algorithm",
    [(n, a) for n, a in RUNS if n != "ddp"],
)
def test_clipped_training_matches_ddp(name: str, algorithm: str, runs: dict[str, Any]) -> None:
    weights = runs["weights"]
    assert_same_weights(
        weights[f"{name}_{algorithm}"], weights[f"ddp_{algorithm}"], f"{name} clip by {algorithm}"
    )
    # The last step's gradients were clipped over the whole model, not per shard.
    for final in (r[f"{name}_{algorithm}"] for r in runs["final_grads"]):
        if algorithm == "norm":
            assert final["norm"] == pytest.approx(CLIP, rel=1e-4), final
        else:
            assert final["max"] == pytest.approx(CLIP, rel=1e-6), final
