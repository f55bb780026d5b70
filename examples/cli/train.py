"""LightningCLI with flatshard: the strategy, its arguments and the precision come from a YAML config.

    python examples/cli/train.py fit --config examples/configs/flatshard.yaml
    python examples/cli/train.py fit --config examples/configs/flatshard_block_bf16.yaml
    python examples/cli/train.py fit --config examples/configs/flatshard_sharded_ckpt.yaml
    python examples/cli/train.py fit --config examples/configs/flatshard.yaml \
        --ckpt_path runs/cli/checkpoints/epoch=0-step=4.ckpt --trainer.max_steps 8         # resume, 4 more steps

Checkpoints land in ``runs/cli/checkpoints/`` (``trainer.default_root_dir``, ignored by git), with the resolved
config in ``runs/cli/config.yaml``; with ``state_dict_type: sharded`` a ``.ckpt`` is a directory. A resumed run
continues up to ``trainer.max_steps``, counted from the start of training: raise it to train further.

The model is the character-level GPT of ``examples/gpt`` (``model.Block`` is its transformer block, the
import path the configs use for wrap and checkpointing policies); the data are windows of the bundled
Shakespeare text. Any ``Trainer`` or ``FlatShardStrategy`` argument can be set in the YAML or on the
command line (``--trainer.strategy.init_args.sharding_strategy SHARD_GRAD_OP``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))  # ``model`` for configs and workers

from model import GPT, CharTokenizer, GPTConfig, TextDataset, load_corpus

import flatshard  # noqa: F401  (registers the strategy names)


class CharGPT(L.LightningModule):
    """A small GPT over the corpus' characters, built in ``configure_model`` (so sharding sees it whole)."""

    def __init__(
        self, block_size: int = 64, n_layer: int = 2, n_head: int = 2, d_model: int = 64, lr: float = 3e-3
    ):
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = CharTokenizer(load_corpus()).vocab_size
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model = GPT(GPTConfig(self.vocab_size, h.block_size, h.n_layer, h.n_head, h.d_model))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Shakespeare(L.LightningDataModule):
    """``max_samples`` windows of ``block_size`` characters, spread evenly over the bundled text."""

    def __init__(self, block_size: int = 64, batch_size: int = 8, max_samples: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        text = load_corpus()
        tokens = CharTokenizer(text).encode_tensor(text)
        data = TextDataset(tokens, self.hparams.block_size, self.hparams.max_samples)
        return DataLoader(data, batch_size=self.hparams.batch_size)


RUNS = Path(__file__).resolve().parents[2] / "runs" / "cli"  # ignored by git: runs leave the repository clean


def main() -> None:
    # Checkpoints go to runs/cli/checkpoints/ and the resolved config to runs/cli/config.yaml unless the YAML or
    # the command line sets trainer.default_root_dir.
    LightningCLI(
        CharGPT,
        Shakespeare,
        trainer_defaults={"default_root_dir": str(RUNS)},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
