"""A small GPT-style, decoder-only, character-level language model in plain PyTorch.

Reusable outside the Lightning example (benchmarks import it), so it only depends on ``torch``.

Contents:

* :class:`GPTConfig`, :class:`Block`, :class:`GPT`: the model. ``GPT.forward(idx) -> logits``.
* :class:`CharTokenizer`: a character-level vocabulary built from a text.
* :class:`TextDataset`: deterministic ``(input, target)`` windows over an encoded text.
* :func:`load_corpus`: the text shipped in ``data/corpus.txt`` (public-domain Shakespeare).
* :func:`generate`: greedy decoding with any callable that maps token ids to logits.

The model is written so that it also works when parameters are only materialised by forward hooks
(as a sharded-training strategy does): a module's ``forward`` only touches its *own* parameters, and
every other submodule is *called* (``self.wte(idx)``, ``self.lm_head(x)``), never accessed as
``self.sub.weight``. The LM head is an ``nn.Linear`` whose ``weight`` is the very same ``Parameter``
object as the token-embedding weight when ``tie_weights`` is set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"

__all__ = [
    "DEFAULT_CORPUS",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "CharTokenizer",
    "GPTConfig",
    "TextDataset",
    "generate",
    "load_corpus",
]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: ``d_model -> 4 * d_model -> d_model`` with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@torch.no_grad()
def init_weights(module: nn.Module) -> None:
    """The GPT's initialisation of one module's own parameters: N(0, 0.02) for Linear/Embedding weights, zero
    biases, ones/zeros for LayerNorm. Also the ``param_init_fn`` for building the GPT on the meta device."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Submodules: ``wte`` (token embedding), ``wpe`` (position embedding), ``drop``, ``blocks``
    (an ``nn.ModuleList`` of :class:`Block`), ``ln_f`` (final LayerNorm) and ``lm_head``
    (``nn.Linear(d_model, vocab_size, bias=False)``, weight tied to ``wte.weight`` when
    ``config.tie_weights``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter object, registered under both modules; ``parameters()`` yields it once.
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re-)initialise every parameter with :func:`init_weights`. Deterministic given the global torch
        RNG state."""
        for module in self.modules():
            init_weights(module)

    @property
    def weights_tied(self) -> bool:
        return self.lm_head.weight is self.wte.weight

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """``idx``: ``(B, T)`` token ids, ``T <= block_size``. Returns ``(B, T, vocab_size)`` logits."""
        if idx.dim() != 2:
            raise ValueError(f"expected idx of shape (batch, time), got {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy decoding, calling this module directly (see :func:`generate`)."""
        return generate(self, idx, max_new_tokens, self.config.block_size)


@torch.no_grad()
def generate(
    forward: Callable[[Tensor], Tensor],
    idx: Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Decode ``max_new_tokens`` tokens: greedy (argmax) at ``temperature`` 0, else sampled from the softmax of
    the logits divided by ``temperature``, restricted to the ``top_k`` most likely tokens if given, drawing from
    ``generator`` (seeded: the same sample on every rank and every run).

    ``forward`` maps ``(B, T)`` token ids to ``(B, T, V)`` logits: a :class:`GPT`, or a wrapper such
    as a LightningModule whose ``__call__`` goes through the module hooks of a sharding strategy.
    Returns ``idx`` extended by ``max_new_tokens`` tokens.
    """
    for _ in range(max_new_tokens):
        logits = forward(idx[:, -block_size:])[:, -1, :].float()
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, next_id], dim=1)
    return idx


def load_corpus(path: str | Path | None = None) -> str:
    """Return the text of ``path`` (default: the shipped ``data/corpus.txt``)."""
    return Path(path if path is not None else DEFAULT_CORPUS).read_text(encoding="utf-8")


class CharTokenizer:
    """Character-level tokenizer: the vocabulary is the sorted set of characters of ``text``."""

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("cannot build a vocabulary from an empty text")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary") from None

    def encode_tensor(self, text: str) -> Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class TextDataset(Dataset[tuple[Tensor, Tensor]]):
    """``(input, target)`` windows of ``block_size`` tokens; ``target`` is ``input`` shifted by one.

    There are ``len(tokens) - block_size`` distinct windows. With ``max_samples=None`` the dataset has
    one item per window (start offsets 0, 1, 2, ...). With ``max_samples=n`` it has exactly ``n``
    items: if ``n`` is smaller than the number of windows, their starts are spread evenly over the
    text; if larger, the windows repeat. No randomness: item ``i`` is always the same.
    """

    def __init__(
        self, tokens: Tensor | Sequence[int], block_size: int, max_samples: int | None = None
    ) -> None:
        self.tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        self.block_size = int(block_size)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_windows = self.tokens.numel() - self.block_size
        if self.num_windows <= 0:
            raise ValueError(
                f"text of {self.tokens.numel()} tokens is too short for block_size {self.block_size}"
            )
        if max_samples is not None and max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples}")
        self.max_samples = max_samples

    def __len__(self) -> int:
        return self.num_windows if self.max_samples is None else self.max_samples

    def start(self, index: int) -> int:
        """Offset in ``tokens`` where item ``index`` begins."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for dataset of length {len(self)}")
        index %= len(self)
        if self.max_samples is None or self.max_samples >= self.num_windows:
            return index % self.num_windows
        return (index * self.num_windows) // self.max_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        s = self.start(index)
        chunk = self.tokens[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def _demo() -> None:  # pragma: no cover - a quick smoke test: ``python examples/gpt/model.py``
    text = load_corpus()
    tok = CharTokenizer(text)
    ds = TextDataset(tok.encode_tensor(text), block_size=64, max_samples=8)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=4, d_model=64))
    x, y = ds[0]
    logits = model(x[None])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    print(f"vocab={tok.vocab_size} params={model.num_parameters()} tied={model.weights_tied}")
    print(f"loss at init {loss.item():.3f} (ln(vocab) = {math.log(tok.vocab_size):.3f})")


if __name__ == "__main__":
    _demo()
