"""The ``tensor_parallel`` scenario's model: a Llama-shaped model of any size, its tensor-parallel plan, the loss,
the presets, identical init and batches.

``Llama`` is the model of ``tests/tp_models.py`` with its sizes in a :class:`LlamaConfig` (grouped-query
attention, SwiGLU, RMSNorm, rotary positions), with the module boundaries torch's tensor-parallel plans need;
:func:`llama_plan` is the usual sequence-parallel plan for it (as torchtitan's): column-wise q/k/v and w1/w3,
row-wise wo and w2, sequence parallelism for the norms, a vocabulary-sharded embedding and a replicated output.
Every contender applies the same plan to the same model before it shards over the data-parallel dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# dim, heads, kv_heads and ffn are divisible by tensor-parallel sizes 1, 2 and 4; seq_len by 4 (sequence parallel)
MODEL_FIELDS = ("dim", "n_layer", "n_head", "n_kv_head", "ffn", "vocab_size", "batch_size", "seq_len")
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2M parameters: smoke runs
    "tiny": dict(dim=64, n_layer=2, n_head=8, n_kv_head=4, ffn=128, vocab_size=256, batch_size=2, seq_len=32),
    # ~16M parameters (the blocks 10M, the embedding and the output 3.1M each), fp32; batch_size per data-parallel
    # rank
    "cpu-small": dict(
        dim=384, n_layer=6, n_head=8, n_kv_head=4, ffn=1024, vocab_size=8192, batch_size=4, seq_len=128
    ),
}


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> LlamaConfig:
        return cls(*(cfg[f] for f in MODEL_FIELDS[:6]))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor) -> torch.Tensor:
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 1.0 / 10_000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
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
        att = F.scaled_dot_product_attention(_rotate(q), _rotate(k), v, is_causal=True, enable_gqa=True)
        out: torch.Tensor = self.wo(att.transpose(1, 2).reshape(b, s, -1))
        return out


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Llama(nn.Module):
    """``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def build_llama(cfg: dict[str, Any]) -> Llama:
    """The Llama of ``cfg``, seeded: the same initial weights on every rank and for every contender."""
    torch.manual_seed(cfg["seed"])
    return Llama(LlamaConfig.of(cfg))


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens`` (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def llama_plan(model: Llama, tp_mesh: Any) -> Llama:
    """torch's usual sequence-parallel Llama plan, applied in place on the 1-D ``tp_mesh``; returns ``model``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            "norm": SequenceParallel(),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def check_divisible(cfg: dict[str, Any], tp: int) -> list[str]:
    """What the plan cannot split over ``tp`` ranks (empty: all fits)."""
    sizes = {
        "--n-head": cfg["n_head"],
        "--n-kv-head": cfg["n_kv_head"],
        "--ffn": cfg["ffn"],
        "--vocab-size": cfg["vocab_size"],
        "--seq-len": cfg["seq_len"],
    }
    bad = [f"{k} {v}" for k, v in sizes.items() if v % tp]
    if cfg["dim"] % cfg["n_head"] or cfg["n_head"] % cfg["n_kv_head"]:
        bad.append(f"--dim {cfg['dim']} / --n-head {cfg['n_head']} / --n-kv-head {cfg['n_kv_head']}")
    return bad


def make_tokens(cfg: dict[str, Any], dp_rank: int, dp: int, n: int) -> list[torch.Tensor]:
    """``n`` global batches of ``batch_size x dp`` sequences from a fixed seed, this data-parallel rank's slice of
    each (the ranks of one tensor-parallel group get the same slice)."""
    b, out = cfg["batch_size"], []
    for step in range(n):
        g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 1000 + step)
        tokens = torch.randint(0, cfg["vocab_size"], (b * dp, cfg["seq_len"] + 1), generator=g)
        out.append(tokens[dp_rank * b : (dp_rank + 1) * b].contiguous())
    return out
