"""Muon through the Trainer and Fabric (see [Note: whole-tensor optimizers]): a LightningModule with
``torch.optim.Muon`` on its matrices and AdamW on the rest (two optimizers, manual optimization), as users write
it, trains under ``strategy="flatshard"`` as under ``strategy="ddp"`` (losses and weights), saves a checkpoint
whose optimizer states are DDP's, and resumes from DDP's checkpoint; the same loop in Fabric likewise."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from ..exact_muon import use_float32_newton_schulz
from .lit_common import (
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    load_ckpt,
    make_loader,
    make_trainer,
)

use_float32_newton_schulz()  # exact parity: see tests/exact_muon.py

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon (torch >= 2.9)"),
]

STEPS, PER_RANK = 4, 2


def _optimizers(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    matrices = [p for n, p in module.named_parameters() if p.ndim == 2 and "wte" not in n]
    rest = [p for n, p in module.named_parameters() if p.ndim != 2 or "wte" in n]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


class MuonGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        muon, adamw = self.optimizers()  # type: ignore[misc]
        loss = self.model.loss(batch[0], batch[1])
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return _optimizers(self)


def _fit(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("flatshard", flatshard.FlatShardStrategy(auto_wrap_policy={Block})),
        ("flatshard_grad_op", "flatshard_grad_op"),
    ):
        recorder = LossRecorder()
        trainer = make_trainer(world, strategy, max_epochs=1, callbacks=[recorder])
        trainer.fit(MuonGPT(), make_loader(STEPS, PER_RANK * world, world))
        trainer.save_checkpoint(os.path.join(folder, f"{name}.ckpt"))
        out[name] = recorder.losses
    # resume flatshard from DDP's checkpoint on this world size, one more epoch, against DDP resumed alike
    for name, strategy in (("ddp_resumed", "ddp"), ("flatshard_resumed", "flatshard")):
        trainer = make_trainer(world, strategy, max_epochs=2)
        trainer.fit(MuonGPT(), make_loader(STEPS, PER_RANK * world, world), ckpt_path=f"{folder}/ddp.ckpt")
        trainer.save_checkpoint(os.path.join(folder, f"{name}.ckpt"))
    return out


@pytest.mark.timeout(400)
def test_muon_under_the_trainer_trains_saves_and_resumes_as_under_ddp(tmp_path: Any) -> None:
    losses = spawn(_fit, 2, str(tmp_path))[0]
    for name in ("flatshard", "flatshard_grad_op"):
        assert len(losses[name]) == STEPS
        for a, b in zip(losses[name], losses["ddp"], strict=True):
            assert abs(a - b) < 1e-5 * max(1.0, abs(b)), (name, losses[name], losses["ddp"])
        ckpt, ddp = load_ckpt(tmp_path / f"{name}.ckpt"), load_ckpt(tmp_path / "ddp.ckpt")
        assert_same_weights(ckpt["state_dict"], ddp["state_dict"], name)
        for mine, theirs in zip(ckpt["optimizer_states"], ddp["optimizer_states"], strict=True):
            assert_same_optimizer_state(mine, theirs, name)  # Muon's momentum buffers and AdamW's state
    resumed, ddp_resumed = (
        load_ckpt(tmp_path / "flatshard_resumed.ckpt"),
        load_ckpt(tmp_path / "ddp_resumed.ckpt"),
    )
    assert resumed["global_step"] == ddp_resumed["global_step"] > 0
    assert_same_weights(resumed["state_dict"], ddp_resumed["state_dict"], "resumed from DDP's checkpoint")


def _fabric_run(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy())
    fabric.launch()
    torch.manual_seed(0)
    model = TinyGPT()
    optimizers = _optimizers(model)  # built on the model as written, before setup shards it
    model, *optimizers = fabric.setup(model, *optimizers)
    losses = []
    for step in range(STEPS):
        idx, tgt = make_batch(step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model.module.loss(idx[mine], tgt[mine])
        fabric.backward(loss)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return {"losses": losses, "state": flatshard.get_state_dict(model.module)[0]}


@pytest.mark.timeout(300)
def test_muon_under_fabric_trains_as_the_unsharded_model() -> None:
    ours = spawn(_fabric_run, 2)[0]
    torch.manual_seed(0)
    model = TinyGPT()
    optimizers = _optimizers(model)
    for step in range(STEPS):  # the whole global batch on one process
        idx, tgt = make_batch(step, PER_RANK * 2)
        loss = model.loss(idx, tgt)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        assert abs(ours["losses"][step] - float(loss)) < 1e-5 * max(1.0, float(loss)), (step, ours["losses"])
    assert_same_weights(ours["state"], model.state_dict(), "Fabric")


class MatrixOnly(torch.optim.SGD):
    """A matrix optimizer flatshard has not been told about: it refuses anything but 2-D gradients."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.ndim != 2:
                    raise ValueError(f"MatrixOnly needs 2-D gradients, got {tuple(p.grad.shape)}")
        return super().step(closure)


def _undeclared(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy())
    fabric.launch()
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = MatrixOnly([p for p in model.parameters() if p.ndim == 2], lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    idx, tgt = make_batch(0, PER_RANK * world)
    fabric.backward(model.module.loss(idx[:PER_RANK], tgt[:PER_RANK]))
    try:
        optimizer.step()
    except ValueError as err:
        return {"error": str(err), "notes": getattr(err, "__notes__", [])}
    return {"error": None}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (Python 3.11)")
def test_an_undeclared_matrix_optimizer_gets_a_hint_with_its_error() -> None:
    for r in spawn(_undeclared, 2):
        assert r["error"] is not None and "MatrixOnly needs 2-D gradients" in r["error"], r
        note = "\n".join(r["notes"])
        assert "MatrixOnly.step() got 1-D pieces" in note and "HINT" in note, note
        assert f'whole_tensor_optimizers=["{__name__}.MatrixOnly"]' in note, note
