"""``FlatShardStrategy(activation_offload=True)``: the Trainer trains exactly as without it on 2 CPU ranks (same
losses, gradients and weights, bit for bit: on CPU the hooks run without copies), with and without activation
checkpointing, for TinyGPT and a tiny Hugging Face Llama; the strategy's option reaches the engine and its hooks
ran (see [Note: activation offload])."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import flatshard
from flatshard.engine import activation_offload_stats
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, LossRecorder, make_loader, make_trainer

STEPS = 3
GLOBAL_BATCH = 4


class LitLlama(L.LightningModule):
    """A tiny random Hugging Face Llama (built from a config: no download), trained on its own loss."""

    def __init__(self) -> None:
        super().__init__()
        from tests.hf.hf_common import tiny_llama  # transformers: only where a case needs it

        self.model, self.block = tiny_llama()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _llama_loader(world: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 64, (STEPS * GLOBAL_BATCH, 12), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=GLOBAL_BATCH // world, shuffle=False)


class _Capture(L.Callback):
    """The gradient pieces of the last step, and the offload counters at the end of fit."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.stats: Any = None

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        # the parameters the optimizers hold (inside a manual training_step the module shows gathered views)
        held = [p for o in trainer.optimizers for group in o.param_groups for p in group["params"]]
        self.grads = {str(i): p.grad.clone() for i, p in enumerate(held) if p.grad is not None}

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stats = activation_offload_stats(module)


def _fit(world: int, model_name: str, checkpointed: bool, offload: bool) -> dict[str, Any]:
    if model_name == "manual":  # two optimizers, backward and steps inside training_step
        from .test_manual_optimization import TwoOptimizerGPT

        module, block, loader = TwoOptimizerGPT("norm"), Block, make_loader(STEPS, GLOBAL_BATCH, world)
    elif model_name == "llama":
        llama = LitLlama()
        module: L.LightningModule = llama
        block: type[torch.nn.Module] = llama.block
        loader = _llama_loader(world)
    else:
        module, block, loader = LitGPT(), Block, make_loader(STEPS, GLOBAL_BATCH, world)
    strategy = flatshard.FlatShardStrategy(
        auto_wrap_policy={block},
        activation_checkpointing_policy={block} if checkpointed else None,
        activation_offload=offload,
    )
    recorder, capture = LossRecorder(), _Capture()
    callbacks = [capture] if model_name == "manual" else [recorder, capture]  # manual: no logged loss
    trainer = make_trainer(world, strategy, max_epochs=1, callbacks=callbacks)
    trainer.fit(module, loader)
    assert trainer.global_step == STEPS * (2 if model_name == "manual" else 1), trainer.global_step
    weights, _ = flatshard.get_state_dict(module, rank0_only=False)
    return {"losses": recorder.losses, "grads": capture.grads, "weights": weights, "stats": capture.stats}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return bool(a) and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _run(rank: int, world: int, cases: list[tuple[str, bool]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for model_name, checkpointed in cases:
        plain = _fit(world, model_name, checkpointed, offload=False)
        moved = _fit(world, model_name, checkpointed, offload=True)
        out[f"{model_name}/{'checkpointed' if checkpointed else 'plain'}"] = {
            "losses": moved["losses"] == plain["losses"]
            and len(plain["losses"]) == STEPS * (model_name != "manual"),
            "grads": _same(moved["grads"], plain["grads"]),
            "weights": _same(moved["weights"], plain["weights"]),
            "stats": moved["stats"],
            "plain_packed": plain["stats"].packed,
        }
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert r["losses"] and r["grads"] and r["weights"], (rank, name, r)
            s = r["stats"]
            assert s.moved > 0 and s.unpacked > 0 and s.records > 0, (rank, name, s)
            assert s.prefetched > 0 and s.late == 0 and s.max_units_back <= 2, (rank, name, s)
            assert len(s.unit_bytes) == 3, (rank, name, s.unit_bytes)  # the blocks, not the LightningModule
            assert r["plain_packed"] == 0, (rank, name)


@pytest.mark.timeout(300)
def test_trainer_activation_offload_parity() -> None:
    _check(spawn(_run, 2, [("gpt", True)]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_activation_offload_more() -> None:
    _check(spawn(_run, 2, [("gpt", False), ("manual", False), ("llama", False), ("llama", True)]))
