"""``FlatShardStrategy(async_save=True)``: sharded saves written in the background.

The same 2-rank run (global batch 6, 3 steps an epoch, 2 epochs) saves with ``ModelCheckpoint`` every step (top-2
by ``train_loss`` plus ``last.ckpt``, so older directories are removed while a newer one is being written), once
synchronously and once asynchronously: the same directories and files result, every directory consolidates to
the same state, and resuming from ``last.ckpt`` gives the same weights and optimizer state. A write made to
fail surfaces on the next save, or at the end of ``fit``, naming the path; bad arguments are refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import flatshard
from flatshard.checkpoint import AsyncSaver, CheckpointError
from flatshard.engine import sharded_model_state_dict
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    fit_and_save,
    load_ckpt,
    make_loader,
    make_trainer,
)

GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 3
EPOCHS = 2

pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")


def _strategy(async_save: bool) -> flatshard.FlatShardStrategy:
    return flatshard.FlatShardStrategy(
        state_dict_type="sharded", auto_wrap_policy={Block}, async_save=async_save
    )


def _fit_with_checkpoints(
    world: int, async_save: bool, dirpath: str, max_epochs: int = EPOCHS
) -> list[float]:
    recorder = LossRecorder()
    callback = ModelCheckpoint(
        dirpath=dirpath, save_top_k=2, monitor="train_loss", save_last=True, every_n_train_steps=1
    )
    trainer = make_trainer(
        world,
        _strategy(async_save),
        max_epochs=max_epochs,
        callbacks=[recorder, callback],
        enable_checkpointing=True,
    )
    trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
    return recorder.losses


def _runs(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for mode in ("sync", "async"):
        ckpts = os.path.join(out_dir, mode)
        losses = _fit_with_checkpoints(world, mode == "async", ckpts)
        resumed = fit_and_save(
            world,
            _strategy(mode == "async"),
            LitGPT(seed=123),  # another init: everything must come from the checkpoint
            make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world),
            EPOCHS + 1,
            os.path.join(out_dir, f"resumed-{mode}"),
            ckpt_path=os.path.join(ckpts, "last.ckpt"),
        )
        results[mode] = {"losses": losses, "resumed": resumed}
    return results


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_async_saves_match_sync_saves(tmp_path: Path) -> None:
    ranks = spawn(_runs, 2, str(tmp_path))
    sync, async_ = ranks[0]["sync"], ranks[0]["async"]
    assert async_["losses"] == sync["losses"]  # saving in the background changes nothing in training

    def layout(root: Path) -> dict[str, list[str]]:
        return {d.name: sorted(os.listdir(d)) for d in sorted(root.iterdir())}

    assert layout(tmp_path / "async") == layout(tmp_path / "sync")
    assert "last.ckpt" in layout(tmp_path / "sync")
    assert len(layout(tmp_path / "sync")) == 3  # top-2 + last: the others were removed
    for name in layout(tmp_path / "sync"):
        expected, actual = tmp_path / f"sync-{name}.full", tmp_path / f"async-{name}.full"
        flatshard.consolidate(tmp_path / "sync" / name, expected)
        flatshard.consolidate(tmp_path / "async" / name, actual)
        exp, got = load_ckpt(expected), load_ckpt(actual)
        assert exp["global_step"] == got["global_step"], name
        assert_same_weights(got["state_dict"], exp["state_dict"], name)
        assert_same_optimizer_state(got["optimizer_states"][0], exp["optimizer_states"][0], name)

    assert async_["resumed"] == sync["resumed"]
    for mode in ("sync", "async"):
        flatshard.consolidate(tmp_path / f"resumed-{mode}", tmp_path / f"resumed-{mode}.full")
    exp, got = load_ckpt(tmp_path / "resumed-sync.full"), load_ckpt(tmp_path / "resumed-async.full")
    assert got["global_step"] == exp["global_step"] == STEPS_PER_EPOCH * (EPOCHS + 1)
    assert_same_weights(got["state_dict"], exp["state_dict"], "resumed")
    assert_same_optimizer_state(got["optimizer_states"][0], exp["optimizer_states"][0], "resumed")


# ------------------------------------------------------------------------------------- failures
def _failing_fit(rank: int, world: int, out_dir: str, fail_on_rank: int, max_steps: int) -> dict[str, Any]:
    """``fit`` with a save every step whose first write fails on ``fail_on_rank``; what each rank raised."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    original = dcp.FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1 and rank == fail_on_rank:
            raise OSError("No space left on device (injected)")
        return original(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    callback = ModelCheckpoint(dirpath=out_dir, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = make_trainer(
        world, _strategy(True), max_steps=max_steps, callbacks=[callback], enable_checkpointing=True
    )
    try:
        trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
    except CheckpointError as err:
        return {"error": str(err), "step": trainer.global_step}
    finally:
        dcp.FileSystemWriter.write_data = original  # type: ignore[method-assign]
    return {"error": None, "step": trainer.global_step}


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_on_rank", [0, 1])
def test_failed_write_surfaces_on_the_next_save(tmp_path: Path, fail_on_rank: int) -> None:
    ranks = spawn(_failing_fit, 2, str(tmp_path), fail_on_rank, STEPS_PER_EPOCH)
    first = os.path.join(str(tmp_path), "step=1.ckpt")
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, rank
        assert first in result["error"], (rank, result["error"])
        assert result["step"] == 2, rank  # raised by the save after step 2, not later
    assert "No space left on device (injected)" in ranks[fail_on_rank]["error"]
    assert not os.path.exists(first)  # never made visible


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_failed_last_write_surfaces_at_the_end_of_fit(tmp_path: Path) -> None:
    ranks = spawn(_failing_fit, 2, str(tmp_path), 1, 1)  # one step, one save: teardown waits for it
    for rank, result in enumerate(ranks):
        assert result["step"] == 1, rank
    # rank 1 failed writing; rank 0's writer thread saw that (through the store) and did not finish the checkpoint
    for result in ranks:
        assert result["error"] is not None and "step=1.ckpt" in result["error"]
        assert "failed on rank 1: OSError: No space left on device (injected)" in result["error"]
    assert sorted(os.listdir(tmp_path)) == []  # the hidden directory went too


class _FailsAtStep2(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 1:
            raise RuntimeError("the run failed (injected)")
        return super().training_step(batch, batch_idx)


def _stuck_peer_fit(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Rank 1's writer never finishes its data file; the run then fails: fit must not wait for that save."""
    import threading

    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    original = dcp.FileSystemWriter.write_data
    release = threading.Event()

    def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            release.wait(120)  # a writer stuck on slow storage (released at the end to exit cleanly)
        return original(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    callback = ModelCheckpoint(dirpath=out_dir, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = make_trainer(
        world, _strategy(True), max_steps=3, callbacks=[callback], enable_checkpointing=True
    )
    started = time.monotonic()
    try:
        trainer.fit(_FailsAtStep2(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    finally:
        release.set()
        dcp.FileSystemWriter.write_data = original  # type: ignore[method-assign]
    return {"error": None, "seconds": time.monotonic() - started}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_run_does_not_wait_for_a_save_that_cannot_finish(tmp_path: Path) -> None:
    ranks = spawn(_stuck_peer_fit, 2, str(tmp_path), timeout=100)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None and "the run failed (injected)" in result["error"], (rank, result)
        assert result["seconds"] < 60, (rank, result)
    assert sorted(os.listdir(tmp_path)) == []  # the unfinished save never became visible, and was removed


# ------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("cls", [flatshard.FlatShardStrategy, flatshard.FlatShardFabricStrategy])
def test_bad_async_save_values_are_refused(cls: Any) -> None:
    with pytest.raises(TypeError, match=r"async_save must be True or False, got 'yes'"):
        cls(state_dict_type="sharded", async_save="yes")
    with pytest.raises(TypeError, match="async_save must be True or False"):
        cls(state_dict_type="sharded", async_save=1)
    with pytest.raises(ValueError, match="async_save=True needs state_dict_type='sharded'.*HINT"):
        cls(async_save=True)
    cls(state_dict_type="sharded", async_save=True)


def test_saves_to_a_url_replace_the_previous_one_whole(tmp_path: Path) -> None:
    """One process, ``memory://``: two saves in a row, each loadable; only the last save's objects remain."""
    import fsspec

    model = torch.nn.Linear(8, 4)
    flatshard.shard(model)
    saver = AsyncSaver()
    url = "memory://async-run/ckpt"
    assert saver.save({"state_dict": sharded_model_state_dict(model), "step": 1}, url) == url
    with torch.no_grad():
        model.weight.add_(1.0)
    saver.save({"state_dict": sharded_model_state_dict(model), "step": 2}, url)  # waits for the first
    saver.wait()
    fresh = torch.nn.Linear(8, 4)
    flatshard.shard(fresh)
    assert flatshard.load_checkpoint(url, fresh) == {"step": 2}
    assert torch.equal(fresh.weight, model.weight)
    names = sorted(p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(url, detail=False))
    data = [n for n in names if n.endswith(".distcp")]
    assert names == sorted([".metadata", "meta.pt", *data]) and len(data) == 1, names


def test_a_failed_save_to_a_url_keeps_the_previous_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, ``memory://``: a save whose metadata write fails raises on the next wait, leaves the
    previous checkpoint loadable and removes its own data object."""
    import fsspec

    from flatshard.checkpoint import remote_dcp

    model = torch.nn.Linear(8, 4)
    flatshard.shard(model)
    saver = AsyncSaver()
    url = "memory://async-failed/ckpt"
    saver.save({"state_dict": sharded_model_state_dict(model), "step": 1}, url)
    saver.wait()
    expected = model.weight.detach().clone()

    def fails(self: object, metadata: object, results: object) -> None:
        raise OSError("connection reset")

    with monkeypatch.context() as mp:
        mp.setattr(remote_dcp.RemoteWriter, "finish", fails)
        with torch.no_grad():
            model.weight.add_(1.0)
        saver.save({"state_dict": sharded_model_state_dict(model), "step": 2}, url)
        with pytest.raises(
            CheckpointError, match=r"memory://async-failed/ckpt failed on rank 0.*connection reset"
        ):
            saver.wait()
    fresh = torch.nn.Linear(8, 4)
    flatshard.shard(fresh)
    assert flatshard.load_checkpoint(url, fresh) == {"step": 1}
    assert torch.equal(fresh.weight, expected)
    fs = fsspec.filesystem("memory")
    assert (
        len([n for n in fs.ls(url, detail=False) if n.endswith(".distcp")]) == 1
    )  # the failed save's data object is removed
    saver.save({"state_dict": sharded_model_state_dict(model), "step": 3}, url)
    saver.wait()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False))
    data = [n for n in names if n.endswith(".distcp")]
    assert names == sorted([".metadata", "meta.pt", *data]) and len(data) == 1, names


def test_remove_of_the_path_in_flight_waits(tmp_path: Path) -> None:
    """One process: removing the directory being written waits for it; removing another does not."""
    model = torch.nn.Linear(8, 4)
    flatshard.shard(model)
    saver = AsyncSaver()
    saver.save({"state_dict": sharded_model_state_dict(model)}, tmp_path / "a")
    saver.save({"state_dict": sharded_model_state_dict(model)}, tmp_path / "b")
    assert (tmp_path / "a" / ".metadata").is_file()  # the second save waited for the first
    saver.wait_for(tmp_path / "a")  # not in flight: returns at once
    assert saver.in_flight == tmp_path / "b"
    saver.wait_for(tmp_path / "b")
    assert saver.in_flight is None
    assert sorted(os.listdir(tmp_path / "b")) == [".metadata", "__0_0.distcp", "meta.pt"]


# ------------------------------------------------------------------------------------- Fabric
def _fabric_run(rank: int, world: int, tmp: str) -> dict[str, float]:
    from lightning.fabric import Fabric

    from flatshard.testing.models import TinyGPT, make_batch

    torch.set_num_threads(1)
    strategy = flatshard.FlatShardFabricStrategy(state_dict_type="sharded", async_save=True)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    idx, tgt = make_batch(0, 2 * world)
    fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
    optimizer.step()
    fabric.save(Path(tmp) / "ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    expected, expected_optim = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
    with torch.no_grad():  # changes after the save returned do not reach the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(Path(tmp) / "ckpt", state)  # waits for the write
    full, optim = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
    strategy.teardown()
    return {
        "weights": max((full[k] - v).abs().max().item() for k, v in expected.items()),
        "optim": max(
            (optim["state"][i]["exp_avg"] - s["exp_avg"]).abs().max().item()
            for i, s in expected_optim["state"].items()
        ),
        "step": float(state["step"]),
    }


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fabric_async_save_and_load(tmp_path: Path) -> None:
    for result in spawn(_fabric_run, 2, str(tmp_path)):
        assert result == {"weights": 0.0, "optim": 0.0, "step": 1.0}
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
