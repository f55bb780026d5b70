"""Llama-shaped models and their tensor-parallel plans for the 2-D tests (see [Note: tensor parallelism]).

``TPLlama`` is a hand-written Llama (grouped-query attention, SwiGLU, RMSNorm, rotary positions) with the module
boundaries torch's tensor-parallel plans need; :func:`llama_plan` is the usual plan for it: column-wise q/k/v and
w1/w3, row-wise wo and w2, sequence parallelism for the norms, a vocabulary-sharded embedding and a replicated
output. :func:`hf_llama_plan` is the same plan for Hugging Face's ``LlamaForCausalLM``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 64, 8, 4, 120, 96, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 1.0 / 10_000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head, bias=False)
        self.wo = nn.Linear(HEADS * self.head, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads: -1, so that a tensor-parallel rank's share of them fits
        q = self.wq(x).view(b, s, -1, self.head).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head).transpose(1, 2)
        att = F.scaled_dot_product_attention(_rotate(q), _rotate(k), v, is_causal=True, enable_gqa=True)
        return self.wo(att.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TPLlama(nn.Module):
    """``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def llama_plan(model: TPLlama, tp_mesh: Any, sequence_parallel: bool = True) -> TPLlama:
    """torch's usual Llama plan (as torchtitan's), applied in place; returns ``model``."""
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


def tiny_hf_llama() -> nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` at test size, with sizes a tensor-parallel size of 4 divides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def hf_llama_plan(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """The same plan for Hugging Face's ``LlamaForCausalLM`` (without sequence parallelism: its decoder layers
    pass position embeddings that a sequence-sharded hidden state would not match)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    return model
