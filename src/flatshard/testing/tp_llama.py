"""A Llama with the module boundaries torch's tensor-parallel plans need, and the usual plan for it.

:class:`TPLlama` (grouped-query attention, SwiGLU, RMSNorm, rotary positions, as :mod:`flatshard.testing.llama`)
splits each block into ``attention`` and ``feed_forward`` submodules, whose inputs a plan can redistribute, and
counts heads as ``-1`` so a tensor-parallel rank's share of them fits. :func:`llama_plan` is torch's usual plan
(as torchtitan's): column-wise q/k/v and w1/w3, row-wise wo and w2, sequence parallelism for the norms, a
vocabulary-sharded embedding and a replicated output (see [Note: tensor parallelism]). Tests, benchmarks and
examples of 2-D training use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatshard.testing.llama import RMSNorm, _rotate

__all__ = ["TPLlama", "TPLlamaBlock", "TPLlamaConfig", "llama_loss", "llama_plan"]

_THETA = 10_000.0


@dataclass(frozen=True)
class TPLlamaConfig:
    """Sizes; the defaults are test sizes a tensor-parallel size of 1, 2 or 4 divides."""

    dim: int = 64
    n_layer: int = 2
    n_head: int = 8
    n_kv_head: int = 4
    ffn: int = 120
    vocab_size: int = 96


class Attention(nn.Module):
    def __init__(self, c: TPLlamaConfig) -> None:
        super().__init__()
        self.head = c.dim // c.n_head
        self.wq = nn.Linear(c.dim, c.n_head * self.head, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_head * self.head, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_head * self.head, bias=False)
        self.wo = nn.Linear(c.n_head * self.head, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads: -1, so that a tensor-parallel rank's share of them fits
        q = self.wq(x).view(b, s, -1, self.head).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head).transpose(1, 2)
        q, k = _rotate(q, _THETA), _rotate(k, _THETA)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out: torch.Tensor = self.wo(att.transpose(1, 2).reshape(b, s, -1))
        return out


class FeedForward(nn.Module):
    def __init__(self, c: TPLlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TPLlamaBlock(nn.Module):
    def __init__(self, c: TPLlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, 1e-5)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, 1e-5)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class TPLlama(nn.Module):
    """``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self, c: TPLlamaConfig | None = None) -> None:
        super().__init__()
        c = c or TPLlamaConfig()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TPLlamaBlock(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.dim, 1e-5)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens`` (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def llama_plan(model: TPLlama, tp_mesh: Any, sequence_parallel: bool = True) -> TPLlama:
    """torch's usual Llama plan applied in place on the 1-D ``tp_mesh``; returns ``model``. Without
    ``sequence_parallel`` the norms stay plain, replicated parameters and activations between blocks whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
            **({"norm": SequenceParallel()} if sequence_parallel else {}),
        },
    )
    for block in model.layers:
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    return model
