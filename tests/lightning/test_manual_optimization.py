"""Manual optimization through the Trainer: backward, clipping and optimizer steps inside ``training_step``.

flatshard runs ``training_step`` as the root unit's forward, so here a backward, a step and a second forward
all happen inside it (see [Note: backward inside a forward] in ``flatshard.engine.runtime``). Each step
alternates two optimizers the way a GAN does: toggle one (Lightning turns ``requires_grad`` off for the
other's parameters), forward, backward, clip, step; then the other, whose forward must see the weights the
first step just changed. Reference: one device, ``strategy="auto"``, the same global batch. SGD at a large
learning rate with clipping far below the gradient norm, so a lost gradient, a stale gathered weight or a
clip computed on one shard shows.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from flatshard.testing import spawn

from .lit_common import (
    LitGPT,
    assert_same_weights,
    load_ckpt,
    make_loader,
    make_trainer,
    strategy_by_name,
    strip_prefix,
)

pytestmark = pytest.mark.slow

STEPS = 3
GLOBAL_BATCH = 4
CLIP = 0.05
RUNS = [("flatshard", "norm"), ("flatshard_block", "value"), ("flatshard_grad_op", "norm")]


class TwoOptimizerGPT(LitGPT):
    """Optimizer 0 trains the blocks, optimizer 1 everything else (embeddings, final norm, head)."""

    def __init__(self, algorithm: str) -> None:
        super().__init__(optimizer="sgd", lr=1.0)
        self.automatic_optimization = False
        self.algorithm = algorithm
        # Per backward: how many of the optimizers' parameters had a gradient after it. (Inside training_step,
        # which flatshard runs as the root's forward, self.parameters() are the gathered views; the optimizers
        # hold the parameters, and their gradient shards.)
        self.grads_seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        idx, target = batch[0], batch[1]
        for opt in self.optimizers():
            self.toggle_optimizer(opt)
            loss = self.model.loss(idx, target)
            self.manual_backward(loss)
            held = [p for o in self.optimizers() for group in o.param_groups for p in group["params"]]
            self.grads_seen.append(sum(p.grad is not None for p in held))
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm=self.algorithm)
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = list(self.model.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [torch.optim.SGD(blocks, lr=self.lr), torch.optim.SGD(rest, lr=self.lr)]


def _fit(world: int, strategy: Any, algorithm: str, out: str) -> list[int]:
    model = TwoOptimizerGPT(algorithm)
    trainer = make_trainer(world, strategy, max_epochs=1)
    trainer.fit(model, make_loader(STEPS, GLOBAL_BATCH, world))
    trainer.save_checkpoint(out)
    return model.grads_seen


def _train(rank: int, world: int, out_dir: str) -> dict[str, list[int]]:
    return {
        f"{name}_{algorithm}": _fit(
            world, strategy_by_name(name), algorithm, os.path.join(out_dir, f"{name}_{algorithm}.ckpt")
        )
        for name, algorithm in RUNS
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("manual")
    ranks = spawn(_train, 2, str(directory))
    references = {}
    for algorithm in ("norm", "value"):
        path = str(directory / f"reference_{algorithm}.ckpt")
        references[algorithm] = {"grads_seen": _fit(1, "auto", algorithm, path), "ckpt": load_ckpt(path)}
    return {
        "ranks": ranks,
        "ckpt": {f"{n}_{a}": load_ckpt(directory / f"{n}_{a}.ckpt") for n, a in RUNS},
        "reference": references,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, algorithm", RUNS)
def test_manual_optimization_matches_one_device(name: str, algorithm: str, runs: dict[str, Any]) -> None:
    run, reference = f"{name}_{algorithm}", runs["reference"][algorithm]
    # Every manual_backward left gradients on the toggled optimizer's parameters only, on every rank.
    assert len(set(reference["grads_seen"])) == 2, reference["grads_seen"]  # the two optimizers differ
    for rank in runs["ranks"]:
        assert rank[run] == reference["grads_seen"], (rank[run], reference["grads_seen"])
    expected = strip_prefix(reference["ckpt"]["state_dict"])
    initial = TwoOptimizerGPT(algorithm).model.state_dict()
    assert max((expected[k] - initial[k]).abs().max().item() for k in initial if k != "steps") > 1e-2
    assert_same_weights(strip_prefix(runs["ckpt"][run]["state_dict"]), expected, run)
