"""The benchmarks' model: the GPT of ``examples/gpt/model.py`` loaded under a fixed module name, the
presets, :func:`build_model` (identical init everywhere) and :func:`make_batches` (the same batches for all).

The benchmark scripts share five modules, one concern each: this one; ``bench_contenders`` (flatshard and its
peers built alike, and the ranks they run on); ``bench_measure`` (``/proc`` readers, peak RSS, the memory
poller); ``bench_checks`` (a contender's output checked before it is compared); ``bench_output`` (machine
info, tables, JSON, plots). The scripts are run as ``python benchmarks/<script>.py``: Python puts
``benchmarks/`` first on ``sys.path``, so ``import bench_model`` works there, and ranks started with the
``spawn`` method get the parent's ``sys.path`` (multiprocessing's preparation data) and import the script,
hence these modules, the same way. Nothing here edits ``sys.path``; flatshard is imported inside the
functions that use it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
GPT_MODEL_PATH = REPO / "examples" / "gpt" / "model.py"
# The name the example GPT's module is registered under in ``sys.modules``: its classes pickle by it, and a
# spawned rank registers the same module under the same name when it imports this one.
GPT_MODULE_NAME = "flatshard_benchmarks_gpt_model"


# ----------------------------------------------------------------------------------------------------------
# The model: examples/gpt/model.py, its presets, the batches
# ----------------------------------------------------------------------------------------------------------


def _load_gpt_module() -> ModuleType:
    """``examples/gpt/model.py`` as the module ``GPT_MODULE_NAME``, loaded from its path (no ``sys.path``
    edit; the file stays where the example uses it). It is registered in ``sys.modules`` before it runs, as
    an import would do: ``dataclasses`` looks the module up while building ``GPTConfig``, and pickle finds
    the classes through it."""
    module = sys.modules.get(GPT_MODULE_NAME)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(GPT_MODULE_NAME, GPT_MODEL_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example GPT from {GPT_MODEL_PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[GPT_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[GPT_MODULE_NAME]
        raise
    return module


gpt_model = _load_gpt_module()
GPT = gpt_model.GPT
GPTConfig = gpt_model.GPTConfig
Block = gpt_model.Block

PRESETS: dict[str, dict[str, Any]] = {
    # vocab 8192 rather than GPT-2's 50257 keeps the small preset dominated by the transformer blocks.
    "cpu-small": dict(
        d_model=512, n_layer=8, n_head=8, batch_size=8, seq_len=128, vocab_size=8192, device="cpu"
    ),
    "cpu-large": dict(
        d_model=1024, n_layer=12, n_head=16, batch_size=1, seq_len=64, vocab_size=50257, device="cpu"
    ),
    "cuda-1b": dict(
        d_model=2048, n_layer=18, n_head=16, batch_size=4, seq_len=1024, vocab_size=50257, device="cuda"
    ),
}
MODEL_FIELDS = ("d_model", "n_layer", "n_head", "batch_size", "seq_len", "vocab_size")


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(cfg["seed"])  # identical init on every rank and for every contender
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


def make_batches(cfg: dict[str, Any], rank: int, world_size: int, device: torch.device) -> list[Any]:
    """One global batch per step from a fixed seed; this rank takes its slice (same for all contenders)."""
    n = cfg["warmup"] + cfg["steps"]
    b = cfg["batch_size"]
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + 1000 + step)
        tokens = torch.randint(0, cfg["vocab_size"], (b * world_size, cfg["seq_len"] + 1), generator=g)
        mine = tokens[rank * b : (rank + 1) * b]
        out.append((mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)))
    return out


class LoRALinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (x @ A.T @ B.T) * alpha / r``.

    ``A`` starts random and ``B`` at zero (LoRA's initialisation, so the first forward is the base model's);
    the adapters live in the module that replaces the linear, hence in the same unit as the frozen weights.
    """

    def __init__(self, base: torch.nn.Linear, r: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(r, base.in_features) / base.in_features**0.5)
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(
            x
        )  # in the base's dtype; the adapters in theirs (fp32 beside a bf16 base, as in peft)
        return out + ((x.to(self.lora_a.dtype) @ self.lora_a.t() @ self.lora_b.t()) * self.scale).to(
            out.dtype
        )


def add_lora(model: torch.nn.Module, r: int) -> int:
    """Freeze every parameter of ``model`` and put rank-``r`` adapters on each block's MLP linears (the
    configuration of a typical adapter fine-tune); returns the number of trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.modules():
        if isinstance(block, Block):
            block.mlp.c_fc = LoRALinear(block.mlp.c_fc, r)
            block.mlp.c_proj = LoRALinear(block.mlp.c_proj, r)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def local_numel(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor -> this rank's shard
        total += local.numel()
    return total
