"""Llama-shaped models and their tensor-parallel plans for the 2-D tests (see [Note: tensor parallelism]).

``TPLlama``, ``Block`` and :func:`llama_plan` are :mod:`flatshard.testing.tp_llama`'s at test size;
:func:`hf_llama_plan` is the same plan for Hugging Face's ``LlamaForCausalLM``.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from flatshard.testing.tp_llama import TPLlama, TPLlamaConfig, llama_loss, llama_plan
from flatshard.testing.tp_llama import TPLlamaBlock as Block

__all__ = ["VOCAB", "Block", "TPLlama", "hf_llama_plan", "llama_loss", "llama_plan", "tiny_hf_llama"]

_SIZES = TPLlamaConfig()
DIM, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = (
    _SIZES.dim,
    _SIZES.n_head,
    _SIZES.n_kv_head,
    _SIZES.ffn,
    _SIZES.vocab_size,
    _SIZES.n_layer,
)


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
