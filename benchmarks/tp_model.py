"""The ``tensor_parallel`` scenario's model: a Llama-shaped model of any size, its tensor-parallel plan, the loss,
the presets, identical init and batches.

The model and plan are :mod:`flatshard.testing.tp_llama`'s (``TPLlama`` with the sizes of a preset, torch's usual
sequence-parallel plan, as torchtitan's).
Every contender applies the same plan to the same model before it shards over the data-parallel dimension.
"""

from __future__ import annotations

from typing import Any

import torch

from flatshard.testing.tp_llama import TPLlama, TPLlamaConfig, llama_loss, llama_plan
from flatshard.testing.tp_llama import TPLlamaBlock as Block

__all__ = ["MODEL_FIELDS", "PRESETS", "Block", "build_llama", "check_divisible", "llama_loss", "llama_plan"]

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


def config_of(cfg: dict[str, Any]) -> TPLlamaConfig:
    return TPLlamaConfig(*(cfg[f] for f in MODEL_FIELDS[:6]))


def build_llama(cfg: dict[str, Any]) -> TPLlama:
    """The Llama of ``cfg``, seeded: the same initial weights on every rank and for every contender."""
    torch.manual_seed(cfg["seed"])
    return TPLlama(config_of(cfg))


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
