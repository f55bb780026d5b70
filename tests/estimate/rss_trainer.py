"""The Trainer rank of the peak-RSS checks (``test_runtime.py``): Lightning's imports come with this module, so
the estimate's runtime measurement, which imports the factory's module, imports them too."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from flatshard import FlatShardStrategy
from tests.estimate.rss_models import BATCH, FACTORIES, VOCAB, _tokens, hf_gpt2, peak_rss, wrap


def hf_gpt2_in_lightning() -> Any:
    """The estimate's target for the Trainer run: the same model and batch, imported beside Lightning."""
    return hf_gpt2()


class CausalLM(L.LightningModule):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.model, _ = FACTORIES[model]()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_rank(rank: int, world: int, model: str, steps: int) -> dict[str, Any]:
    """``Trainer(strategy=FlatShardStrategy(...))`` fits ``steps`` steps of one rank's batch; the rank's peak RSS."""
    torch.manual_seed(0)
    module = CausalLM(model)
    ids = _tokens(VOCAB).repeat(world * steps, 1)  # every rank gets one batch of BATCH sequences per step
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=FlatShardStrategy(auto_wrap_policy=wrap(model)),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=BATCH))
    return {**peak_rss(), "steps": trainer.global_step}
