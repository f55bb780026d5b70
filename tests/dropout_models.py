"""A TinyGPT whose blocks use dropout, for checkpointing tests: a recomputation that drew other random numbers
than the forward would give other gradients."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatshard.testing.models import Block, TinyGPT

__all__ = ["DropoutBlock", "dropout_gpt"]


class DropoutBlock(Block):
    """A block whose attention and MLP outputs go through dropout, between matrix products."""

    def __init__(self, d_model: int, p: float = 0.2) -> None:
        super().__init__(d_model)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.ln1(x)).split(x.shape[-1], dim=-1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att))
        out: torch.Tensor = x + self.drop(self.out(self.drop(F.gelu(self.fc(self.ln2(x))))))
        return out


def dropout_gpt(d_model: int = 16, n_layer: int = 3) -> TinyGPT:
    """TinyGPT with :class:`DropoutBlock` blocks (seed the caller's RNG first for the same weights)."""
    model = TinyGPT(d_model=d_model, n_layer=n_layer)
    model.blocks = nn.ModuleList([DropoutBlock(d_model) for _ in range(n_layer)])
    return model
