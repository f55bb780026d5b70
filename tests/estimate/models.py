"""The model the estimator's measured checks run: the same factory builds it on the meta device (estimate) and
on CPU ranks (the real run)."""

from __future__ import annotations

import torch
import torch.nn as nn

from flatshard.testing.models import Block, TinyGPT

__all__ = ["BATCH", "SEQ", "VOCAB", "gpt", "gpt_without_batch"]

VOCAB, SEQ, BATCH = 512, 32, 4


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # on CPU: the generator's device
    return idx.to(torch.get_default_device())


def gpt() -> tuple[nn.Module, torch.Tensor]:
    """A small GPT (tied head, odd sizes that never divide evenly) and a batch of token ids."""
    return TinyGPT(vocab=VOCAB, d_model=96, n_layer=4, block=SEQ), _batch()


def gpt_without_batch() -> nn.Module:
    return TinyGPT(vocab=VOCAB, d_model=96, n_layer=4, block=SEQ)


WRAP = {Block}


def gpt_large_vocab() -> tuple[nn.Module, torch.Tensor]:
    """Its embedding (6 MiB) is gathered into a mapping of its own on CPU ranks: the large-buffer path."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 12_000, (2, SEQ), generator=g).to(torch.get_default_device())
    return TinyGPT(vocab=12_000, d_model=128, n_layer=2, block=SEQ), idx
