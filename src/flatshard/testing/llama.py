"""A Llama-style decoder built from published dimensions, for estimates and checks (no weights, no download).

``llama_1b``, ``llama_8b`` and ``llama_70b`` return ``(model, (tokens, targets))`` with the dimensions of
Llama 3.2 1B and Llama 3.1 8B / 70B (grouped-query attention, SwiGLU MLP, RMSNorm, rotary positions, a
128,256-token vocabulary) and a batch of one 4,096-token sequence: targets for
``flatshard estimate flatshard.testing.llama:llama_8b --world-size 8,64,512``. ``tiny_llama`` is the same
architecture at test size. :func:`tensor_parallel_plan` parallelizes any of them with torch's
``parallelize_module`` (see [Note: tensor parallelism]): the plan ``flatshard estimate --tensor-parallel-size``
uses for this module's targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "llama",
    "llama_1b",
    "llama_8b",
    "llama_70b",
    "tensor_parallel_plan",
    "tiny_llama",
]


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int = 128_256
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0


CONFIGS = MappingProxyType(
    {
        "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True),
        "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
        "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    }
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim)."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class LlamaBlock(nn.Module):
    """Pre-norm block: grouped-query self-attention and a SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        head = cfg.dim // cfg.n_heads
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        head = cfg.dim // cfg.n_heads
        h = self.attention_norm(x)
        # heads: -1, so that a tensor-parallel rank's share of them fits (see tensor_parallel_plan)
        q = self.wq(h).view(b, s, -1, head).transpose(1, 2)
        k = self.wk(h).view(b, s, -1, head).transpose(1, 2)
        v = self.wv(h).view(b, s, -1, head).transpose(1, 2)
        q, k = _rotate(q, cfg.rope_theta), _rotate(k, cfg.rope_theta)
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=cfg.n_kv_heads != cfg.n_heads
        )
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


class Llama(nn.Module):
    """Token embedding, blocks, final norm, output head; ``forward(tokens, targets)`` returns the loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def llama(size: str, seq: int = 4096, batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A Llama of ``size`` (``"1b"``, ``"8b"``, ``"70b"``) and a batch of ``batch`` sequences of ``seq`` tokens."""
    if size not in CONFIGS:
        raise ValueError(
            f"llama size {size!r} is not one of {sorted(CONFIGS)}. HINT: use '1b', '8b' or '70b'."
        )
    cfg = CONFIGS[size]
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    return Llama(cfg), (tokens, tokens)


def llama_1b() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return llama("1b")


def llama_8b() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return llama("8b")


def llama_70b() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return llama("70b")


def tiny_llama(seq: int = 32, batch: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The same architecture at test size (odd sizes, so shards never divide evenly)."""
    cfg = LlamaConfig(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=250, vocab=509)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(torch.get_default_device())
    return Llama(cfg), (tokens[:, :-1], tokens[:, 1:])


def tensor_parallel_plan(model: Llama, tp_mesh: Any) -> Llama:
    """Parallelize ``model`` over the 1-D mesh ``tp_mesh`` in place (Megatron's layout, without sequence
    parallelism); returns ``model``.

    Column-wise ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` (each rank computes its share of the heads and of the
    hidden features), row-wise ``wo`` and ``w2`` (their partial sums are all-reduced), a vocabulary-sharded
    embedding (its partial rows all-reduced) and a vocabulary-sharded output whose logits are all-gathered. Norms
    stay replicated: they run on the whole hidden state. The blocks compute attention inline, so the plan needs no
    module boundaries inside them. A tied embedding stays tied (both sides shard the vocabulary).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not isinstance(model, Llama):
        raise TypeError(
            f"tensor_parallel_plan takes a flatshard.testing.llama.Llama, got {type(model).__name__}. HINT: give "
            "your model's own plan (a function (model, tp_mesh) -> model)."
        )
    cfg, size = model.cfg, tp_mesh.size()
    if cfg.n_heads % size or cfg.n_kv_heads % size:
        raise ValueError(
            f"a tensor-parallel size of {size} does not divide the model's {cfg.n_heads} attention heads and "
            f"{cfg.n_kv_heads} key/value heads. HINT: use a divisor of {cfg.n_kv_heads}."
        )
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if cfg.tie_embeddings:  # both weights are Shard(0) over the vocabulary: keep one
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                **{name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")},
                **{name: RowwiseParallel() for name in ("wo", "w2")},
            },
        )
    return model
