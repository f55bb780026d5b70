"""Small reference models for parity tests: tied weights, sizes that do not divide by 3, frozen parts."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "TinyGPT", "make_batch"]


class Block(nn.Module):
    """Pre-norm transformer block with odd sizes (d_model 13, hidden 29) so shards never divide evenly."""

    def __init__(self, d_model: int = 13, hidden: int = 29, n_head: int = 1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        # No bias: the key bias gets an exactly-zero gradient that Adam would amplify from rounding noise.
        self.attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, d_model)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[-1]
        q, k, v = self.attn(self.ln1(x)).split(c, dim=-1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att)
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """A tiny decoder: token + position embeddings, blocks, final norm, head tied to the embedding."""

    def __init__(
        self, vocab: int = 37, d_model: int = 13, n_layer: int = 3, block: int = 11, tie: bool = True
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList([Block(d_model) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def reset_parameters(self) -> None:
        """The module's own state (its children have their own): ``steps`` back to zero."""
        steps = self.get_buffer("steps")
        with torch.no_grad():
            steps.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding, one forward per new token (like a Hugging Face model's ``generate``)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.wpe.num_embeddings :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_batch(
    step: int, global_batch: int, seq: int = 7, vocab: int = 37
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step`` (every rank can build it and take its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]
