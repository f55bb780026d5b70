"""Models and ranks of the peak-RSS checks of the CPU estimate (``test_runtime.py``).

The ranks import this module, and the estimate's runtime measurement imports it too (it holds the factories):
so it imports what a training script of these models imports (torch, transformers, flatshard) and nothing of
the test suite. Each factory builds the model from a config (nothing is downloaded) and returns it with one
rank's batch; their parameters weigh tens of MB, so the model's bytes are a good part of a rank's peak.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

import flatshard
from flatshard.estimator import training_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB, SEQ, BATCH = 32_000, 64, 2


def _tokens(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g).to(torch.get_default_device())


def hf_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny random Hugging Face Llama (grouped-query attention, untied head): 19.2M parameters, 73 MiB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    ids = _tokens(VOCAB)
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def hf_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny random Hugging Face GPT-2 (tied head, Conv1D layers): 11.4M parameters, 43 MiB."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = _tokens(VOCAB)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


class MLP(nn.Module):
    """A plain residual MLP without any import beyond torch: 33.6M parameters, 128 MiB."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x).pow(2).mean()


def mlp() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return MLP(), torch.randn(BATCH * SEQ, 1024, generator=g).to(torch.get_default_device())


FACTORIES = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2, "mlp": mlp}


def wrap(model: str) -> set[type[nn.Module]]:
    """One unit per block."""
    if model == "hf_llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return {LlamaDecoderLayer}
    if model == "hf_gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return {GPT2Block}
    return {nn.Sequential}


def peak_rss() -> dict[str, int]:
    """This process's peak RSS (``VmHWM``, what the benchmarks report) and the shared-memory pages in its RSS now,
    in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmHWM", "RssShmem"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def shard_rank(rank: int, world: int, model: str, steps: int) -> dict[str, Any]:
    """``flatshard.shard()`` and AdamW, ``steps`` training steps in Lightning's order; the rank's peak RSS."""
    torch.manual_seed(0)
    module, batch = FACTORIES[model]()
    flatshard.shard(module, device=torch.device("cpu"), auto_wrap_policy=wrap(model))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses = [training_step(module, batch, optimizer).item() for _ in range(steps)]
    return {**peak_rss(), "losses": losses}
