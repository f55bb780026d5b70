"""Greedy ``generate()`` of flatshard-trained Hugging Face models (GPT-2, T5) gives what the same model
trained under DDP gives, in every way a user calls it:

(i)   on all ranks inside ``flatshard.unshard_params(module, writeback=False)``;
(ii)  on rank 0 alone inside ``flatshard.unshard_params(module, rank0_only=True, writeback=False)``, the other
      ranks doing nothing inside;
(iii) plainly, ``module.model.generate(...)`` on all ranks after ``trainer.fit`` (the strategy registers
      ``generate`` on the submodules that define one); again after (i) and (ii), the model sharded again;
(iv)  in callback hooks (``on_validation_epoch_end``, ``on_train_end``) on all ranks;
(v)   in a Fabric loop, on the HF model held as an attribute of the module given to ``fabric.setup``.

The DDP reference calls ``generate`` plainly at the same points. The models are dropout-free and seeded, so
the tokens must be equal, and the logits of every decoding step equal to 1e-5. Each Trainer case runs with
one root unit and with one unit per transformer block.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.testing import spawn

from .hf_common import (
    WEIGHT_TOL,
    LitHF,
    assert_same_generation,
    build_model,
    generate,
    make_dataset,
    make_loader,
    make_trainer,
    model_loss,
    strategy_for,
)

pytestmark = pytest.mark.slow

KINDS = ("gpt2", "t5")
STRATEGIES = ("ddp", "flatshard", "flatshard_block")
GLOBAL_BATCH = 4
HOOKS = {"on_validation_epoch_end", "on_train_end"}


class Sampler(Callback):
    """(iv): ``generate`` inside callback hooks, on every rank."""

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.samples["on_validation_epoch_end"] = generate(pl_module.kind, pl_module.model)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.samples["on_train_end"] = generate(pl_module.kind, pl_module.model)


class LitGenerating(LitHF):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.samples: dict[str, dict[str, Any]] = {}


def _trainer_runs(rank: int, world: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Every (model, strategy) fitted for 2 steps and validated once, generating at every point."""
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in KINDS:
        for name in STRATEGIES:
            module = LitGenerating(kind)
            trainer = make_trainer(
                world, strategy_for(kind, name), callbacks=[Sampler()], max_steps=2, limit_val_batches=1
            )
            trainer.fit(
                module,
                make_loader(kind, 2, GLOBAL_BATCH, world),
                val_dataloaders=make_loader(kind, 1, GLOBAL_BATCH, world),
            )
            samples = module.samples
            samples["after_fit"] = generate(kind, module.model)  # (iii)
            if name != "ddp":
                with flatshard.unshard_params(module, writeback=False):  # (i)
                    samples["unshard_params"] = generate(kind, module.model)
                with flatshard.unshard_params(module, rank0_only=True, writeback=False):  # (ii)
                    if trainer.global_rank == 0:
                        samples["unshard_params_rank0_only"] = generate(kind, module.model)
                samples["after_unshard_params"] = generate(kind, module.model)  # (iii) once more
            results[f"{kind}-{name}"] = samples
    return results


def test_generate_after_fit_in_unshard_params_and_in_hooks_matches_ddp() -> None:
    ranks = spawn(_trainer_runs, 2)
    for kind in KINDS:
        ddp = [ranks[rank][f"{kind}-ddp"] for rank in range(2)]
        assert set(ddp[0]) == {*HOOKS, "after_fit"}
        assert_same_generation(ddp[1]["after_fit"], ddp[0]["after_fit"], (kind, "ddp rank 1"))
        # The comparison can tell trained weights from others: the untrained model's logits are far off.
        untrained = generate(kind, build_model(kind))
        assert not torch.allclose(untrained["logits"], ddp[0]["after_fit"]["logits"], **WEIGHT_TOL)
        for name in STRATEGIES[1:]:
            for rank in range(2):
                ours = ranks[rank][f"{kind}-{name}"]
                points = {*HOOKS, "after_fit", "unshard_params", "after_unshard_params"}
                if rank == 0:
                    points.add("unshard_params_rank0_only")
                assert set(ours) == points, (kind, name, rank, sorted(ours))
                for point, sample in ours.items():
                    reference = ddp[rank][point if point in HOOKS else "after_fit"]
                    assert_same_generation(sample, reference, (kind, name, rank, point))


class _Wrapper(torch.nn.Module):
    """The HF model is an attribute of the module Fabric sets up."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.hf = build_model(kind)

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return model_loss(self.kind, self.hf, batch)


def _fabric(rank: int, world: int, strategy: str) -> dict[str, dict[str, Any]]:
    """(v): each model trained 2 steps in a Fabric loop (same global batch on any strategy), then generating."""
    torch.set_num_threads(1)
    results = {}
    for kind in KINDS:
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = _Wrapper(kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
        data = make_dataset(kind, 2, GLOBAL_BATCH).tensors
        per = GLOBAL_BATCH // world
        for step in range(2):
            lo = step * GLOBAL_BATCH + rank * per
            fabric.backward(model(*(t[lo : lo + per] for t in data)))
            optimizer.step()
            optimizer.zero_grad()
        results[kind] = generate(kind, model.hf)
    return results


def test_generate_in_a_fabric_loop_matches_ddp() -> None:
    ours, ddp = spawn(_fabric, 2, "flatshard"), spawn(_fabric, 2, "ddp")
    for kind in KINDS:
        for rank in range(2):
            assert_same_generation(ours[rank][kind], ddp[rank][kind], (kind, rank))
        assert_same_generation(ddp[1][kind], ddp[0][kind], (kind, "ddp rank 1"))
