"""The benchmarks' model: the GPT of ``examples/gpt/model.py``, its presets, identical init and batches."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
_GPT_FILE = REPO / "examples" / "gpt" / "model.py"
_GPT_MODULE = "flatshard_benchmarks_gpt_model"  # registered in sys.modules: dataclasses and pickle look it up


def _load_gpt() -> ModuleType:
    """``examples/gpt/model.py`` loaded from its path (the example keeps it there), once per process."""
    if _GPT_MODULE in sys.modules:
        return sys.modules[_GPT_MODULE]
    spec = importlib.util.spec_from_file_location(_GPT_MODULE, _GPT_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example GPT from {_GPT_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_GPT_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_GPT_MODULE]
        raise
    return module


_gpt = _load_gpt()
GPT, GPTConfig, Block = _gpt.GPT, _gpt.GPTConfig, _gpt.Block

MODEL_FIELDS = ("d_model", "n_layer", "n_head", "batch_size", "seq_len", "vocab_size")
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layer=2, n_head=4, batch_size=2, seq_len=32, vocab_size=512, device="cpu"),
    # vocab 8192 rather than GPT-2's 50257 keeps the small preset dominated by the blocks: 29.5M parameters
    "cpu-small": dict(
        d_model=512, n_layer=8, n_head=8, batch_size=8, seq_len=128, vocab_size=8192, device="cpu"
    ),
    # GPT-2-medium's width, half its depth, GPT-2's vocabulary (tied): 203M parameters
    "cpu-large": dict(
        d_model=1024, n_layer=12, n_head=16, batch_size=1, seq_len=64, vocab_size=50257, device="cpu"
    ),
    # 1.01B parameters, bf16-mixed, one rank per GPU
    "cuda-1b": dict(
        d_model=2048, n_layer=18, n_head=16, batch_size=4, seq_len=1024, vocab_size=50257, device="cuda"
    ),
}


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """The GPT of ``cfg``, seeded: the same initial weights on every rank and for every contender."""
    torch.manual_seed(cfg["seed"])
    config = GPTConfig(
        vocab_size=cfg["vocab_size"],
        block_size=cfg["seq_len"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        d_model=cfg["d_model"],
        dropout=0.0,
        tie_weights=True,
        bias=True,
    )
    return GPT(config)


def make_batches(cfg: dict[str, Any], rank: int, world: int, device: torch.device, n: int) -> list[Any]:
    """``n`` global batches from a fixed seed, this rank's slice of each (the same for every contender)."""
    b = cfg["batch_size"]
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 1000 + step)
        tokens = torch.randint(0, cfg["vocab_size"], (b * world, cfg["seq_len"] + 1), generator=g)
        mine = tokens[rank * b : (rank + 1) * b]
        out.append((mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)))
    return out


class LoRALinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``r`` update ``x @ A.T @ B.T * alpha / r`` (``B`` starts at
    zero, as LoRA does); the adapters live in the module that replaces the linear, so in the same unit."""

    def __init__(self, base: torch.nn.Linear, r: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(r, base.in_features) / base.in_features**0.5)
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # in the base's dtype; the adapters in theirs (fp32 beside a bf16 base, as peft)
        update = x.to(self.lora_a.dtype) @ self.lora_a.t() @ self.lora_b.t()
        return out + (update * self.scale).to(out.dtype)


def add_lora(model: torch.nn.Module, r: int) -> int:
    """Freeze ``model`` and put rank-``r`` adapters on every block's MLP linears; returns the trainable count."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.modules():
        if isinstance(block, Block):
            block.mlp.c_fc = LoRALinear(block.mlp.c_fc, r)
            block.mlp.c_proj = LoRALinear(block.mlp.c_proj, r)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def local_numel(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds (an FSDP2 DTensor counts its local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
