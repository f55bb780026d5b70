"""Pieces shared by the pretrained-weights tests: tiny Llama checkpoints written by transformers itself, the
meta-built model the recipe shards, and the comparison against ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

VOCAB = 96


def llama_config(tie: bool = False, layers: int = 3, hidden: int = 32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 8,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rope_theta=5000.0,
    )


def write_checkpoint(
    out: Path, tie: bool = False, max_shard_size: str | int = "5GB", safe: bool = True, seed: int = 0
) -> Path:
    """A random tiny Llama saved by transformers' ``save_pretrained`` (the layout users download)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(tie))
    with torch.no_grad():  # norms away from ones, so a norm left at its init value would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if safe:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    else:  # transformers no longer writes .bin checkpoints; older ones hold exactly this
        model.config.save_pretrained(out)
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def meta_model(tie: bool = False, dtype: torch.dtype | None = None) -> Any:
    """The model as the guide's recipe builds it: ``from_config`` under the meta device, in ``dtype``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(tie), dtype=dtype or torch.float32)
    return model.eval()


def reference(path: Path, dtype: torch.dtype | None = None) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()


def tokens(batch: int = 2, seq: int = 10, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


BLOCK = LlamaDecoderLayer
