"""``cpu_offload="optimizer"`` through the Trainer and Fabric (see [Note: optimizer offload]): on 2 CPU ranks the
offloaded step trains exactly as the step without offload (bf16-mixed, gradient clipping, accumulation), writes
the same checkpoint files, and resumes across offload and no offload either way."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from .lit_common import LitGPT, LossRecorder, load_ckpt, make_loader, make_trainer

STEPS = 4  # batches per epoch; with accumulate_grad_batches=2, two optimizer steps


def _strategy(offload: bool | str) -> flatshard.FlatShardStrategy:
    return flatshard.FlatShardStrategy(auto_wrap_policy={Block}, cpu_offload=offload)


def _hosts_used(model: torch.nn.Module) -> int:
    """Units whose host copies the optimizer stepped on."""
    return sum(
        1 for s in unit_states(model) for h in s.handles if h.host is not None and h.host.params is not None
    )


def _fit(world: int, offload: bool | str, out: str, epochs: int, ckpt: str | None = None) -> dict[str, Any]:
    model = LitGPT()
    recorder = LossRecorder()
    trainer = make_trainer(
        world,
        _strategy(offload),
        max_epochs=epochs,
        callbacks=[recorder],
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
    )
    trainer.fit(model, make_loader(STEPS, 2 * world, world), ckpt_path=ckpt)
    trainer.save_checkpoint(out)
    return {"losses": recorder.losses, "hosts": _hosts_used(model), "step": trainer.global_step}


def _trainer_runs(rank: int, world: int, tmp: str, resume: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, offload in (("plain", False), ("offload", "optimizer")):
        out[name] = _fit(world, offload, os.path.join(tmp, f"{name}.ckpt"), 1)
    resumed = (("plain_to_offload", "optimizer", "plain"), ("offload_to_plain", False, "offload"))
    for name, offload, source in resumed if resume else ():
        out[name] = _fit(
            world, offload, os.path.join(tmp, f"{name}.ckpt"), 2, os.path.join(tmp, f"{source}.ckpt")
        )
    return out


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (where, sorted(a, key=str), sorted(b, key=str))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_trainer_offload_trains_saves_and_resumes_as_without(tmp_path: Path, resume: bool) -> None:
    ranks = spawn(_trainer_runs, 2, str(tmp_path), resume)
    for r in ranks:
        assert r["offload"]["hosts"] > 0 and r["plain"]["hosts"] == 0, r
        assert r["offload"]["losses"] == r["plain"]["losses"], r
        assert r["offload"]["step"] == 2, r
    files = {n: load_ckpt(tmp_path / f"{n}.ckpt") for n in ("plain", "offload")}
    _same(files["offload"]["state_dict"], files["plain"]["state_dict"], "state_dict")
    _same(files["offload"]["optimizer_states"], files["plain"]["optimizer_states"], "optimizer_states")
    if not resume:
        return
    # a run resumed across offload and no offload is the one resumed without: the second epoch from either file
    for r in ranks:
        assert r["plain_to_offload"]["losses"] == r["offload_to_plain"]["losses"], r
        assert r["plain_to_offload"]["step"] == 4, r
    a, b = (load_ckpt(tmp_path / f"{n}.ckpt") for n in ("plain_to_offload", "offload_to_plain"))
    _same(a["state_dict"], b["state_dict"], "resumed state_dict")
    _same(a["optimizer_states"], b["optimizer_states"], "resumed optimizer_states")


# ---------------------------------------------------------------------------------------------- Fabric
def _fabric_steps(
    fabric: Fabric, rank: int, world: int, model: Any, optimizer: Any, steps: range
) -> list[float]:
    losses = []
    mine = slice(2 * rank, 2 * rank + 2)
    for step in steps:
        idx, tgt = make_batch(step, 2 * world)
        loss = torch.nn.functional.cross_entropy(model(idx[mine]).flatten(0, 1), tgt[mine].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fabric_setup(world: int, offload: bool | str) -> tuple[Fabric, Any, Any]:
    strategy = flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block}, cpu_offload=offload)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _fabric_runs(rank: int, world: int, tmp: str, resume: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for offload in ("optimizer", False):
        fabric, model, optimizer = _fabric_setup(world, offload)
        losses = _fabric_steps(fabric, rank, world, model, optimizer, range(3))
        fabric.save(Path(tmp) / f"{offload}.ckpt", {"model": model, "optimizer": optimizer})
        more = _fabric_steps(fabric, rank, world, model, optimizer, range(3, 5))
        full = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
        out[str(offload)] = {"losses": losses + more, "state": full, "hosts": _hosts_used(model)}
    for first, then in (("optimizer", False), (False, "optimizer")) if resume else ():  # resume across
        fabric, model, optimizer = _fabric_setup(world, then)
        fabric.load(Path(tmp) / f"{first}.ckpt", {"model": model, "optimizer": optimizer})
        losses = _fabric_steps(fabric, rank, world, model, optimizer, range(3, 5))
        full = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
        out[f"{first}->{then}"] = {"losses": losses, "state": copy.deepcopy(full)}
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fabric_offload_trains_saves_and_resumes_as_without(tmp_path: Path, resume: bool) -> None:
    for r in spawn(_fabric_runs, 2, str(tmp_path), resume):
        mine, plain = r["optimizer"], r["False"]
        assert mine["hosts"] > 0, r
        assert mine["losses"] == plain["losses"]
        _same(mine["state"], plain["state"], "fabric")
        for across in ("optimizer->False", "False->optimizer") if resume else ():
            assert r[across]["losses"] == plain["losses"][3:], across
            _same(r[across]["state"], plain["state"], across)
    _same(
        torch.load(tmp_path / "optimizer.ckpt", weights_only=False),
        torch.load(tmp_path / "False.ckpt", weights_only=False),
        "files",
    )


# ---------------------------------------------------------------------------------------------- manual optimization
def _manual_runs(rank: int, world: int, tmp: str) -> None:
    """Two optimizers stepped inside ``training_step`` (the root's forward), the second forward after the first
    step: the offloaded steps' updates reach that forward as the device steps' do."""
    from .test_manual_optimization import TwoOptimizerGPT

    torch.set_num_threads(1)
    for offload in (False, "optimizer"):
        model = TwoOptimizerGPT("norm")
        trainer = make_trainer(world, _strategy(offload), max_epochs=1)
        trainer.fit(model, make_loader(3, 4, world))
        trainer.save_checkpoint(os.path.join(tmp, f"manual_{offload}.ckpt"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_manual_optimization_with_offload(tmp_path: Path) -> None:
    spawn(_manual_runs, 2, str(tmp_path))
    a, b = (load_ckpt(tmp_path / f"manual_{n}.ckpt") for n in ("optimizer", "False"))
    _same(a["state_dict"], b["state_dict"], "state_dict")
    _same(a["optimizer_states"], b["optimizer_states"], "optimizer_states")
