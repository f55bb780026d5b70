"""Trainer checkpoints with ``state_dict_type="sharded"``: directories written by every rank.

Global batch 6 throughout (2 ranks x 3, 3 ranks x 2, 1 device x 6), 3 steps per epoch. The 2-rank runs save
on the ``Block`` wrap policy; they are resumed on 3 ranks under other wrap policies and on 1 device, and every
result is compared with single-device Lightning (``strategy="auto"``) that saved at the same point and resumed
the same way. The ``ModelCheckpoint`` runs (top-2 by ``train_loss`` plus ``last.ckpt``, a save every step)
are compared with the same callback on 1 device: same file names kept, same contents.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import flatshard
from flatshard.checkpoint import is_sharded_checkpoint
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
    train_reference,
)

GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 3
FIRST_EPOCHS, TOTAL_EPOCHS = 1, 2
TOPK_EPOCHS = 2  # the ModelCheckpoint run: 6 saves, of which top-2 + last.ckpt remain
LOSS_TOL = {"atol": 1e-5, "rtol": 1e-5}

# Resuming from a ModelCheckpoint's file without that callback is intended here (both sides do it).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
]


def _top_k_callback(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=dirpath, save_top_k=2, monitor="train_loss", save_last=True, every_n_train_steps=1
    )


def _strategy(state_dict_type: str, policy: str) -> flatshard.FlatShardStrategy:
    wrap = {"block": {Block}, "root": None, "size": 100}[policy]
    return flatshard.FlatShardStrategy(
        state_dict_type=state_dict_type, sharding_strategy="FULL_SHARD", auto_wrap_policy=wrap
    )


# ------------------------------------------------------------------------------------- in spawned ranks
def _first_runs(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """The same training twice (one save of each type), then a ModelCheckpoint run writing directories."""
    results: dict[str, Any] = {}
    for state_dict_type in ("sharded", "full"):
        results[state_dict_type] = fit_and_save(
            world,
            _strategy(state_dict_type, "block"),
            LitGPT(),
            make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world),
            FIRST_EPOCHS,
            os.path.join(out_dir, f"{state_dict_type}.ckpt"),
        )
    recorder = LossRecorder()
    callback = _top_k_callback(os.path.join(out_dir, "topk"))
    trainer = make_trainer(
        world,
        _strategy("sharded", "block"),
        max_epochs=TOPK_EPOCHS,
        callbacks=[recorder, callback],
        enable_checkpointing=True,
    )
    trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
    results["topk"] = {
        "losses": recorder.losses,
        "best_k": sorted(os.path.basename(p) for p in callback.best_k_models),
        "last": os.path.basename(callback.last_model_path),
    }
    return results


# (resumed run, checkpoint it resumes from, state_dict_type of its own final save, wrap policy, epochs)
RESUMES = [
    ("root_from_sharded", "sharded.ckpt", "sharded", "root", TOTAL_EPOCHS),
    ("size_from_sharded", "sharded.ckpt", "full", "size", TOTAL_EPOCHS),
    ("root_from_last", os.path.join("topk", "last.ckpt"), "full", "root", TOPK_EPOCHS + 1),
]


def _resumed_runs(rank: int, world: int, first_dir: str, out_dir: str) -> dict[str, Any]:
    return {
        name: fit_and_save(
            world,
            _strategy(state_dict_type, policy),
            LitGPT(seed=123),  # another init: everything must come from the checkpoint
            make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world),
            epochs,
            os.path.join(out_dir, f"{name}.ckpt"),
            ckpt_path=os.path.join(first_dir, source),
        )
        for name, source, state_dict_type, policy, epochs in RESUMES
    }


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def first_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("first")
    ranks = spawn(_first_runs, 2, str(directory))
    return {"dir": directory, "ranks": ranks}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """1 device, strategy="auto": the same saves, resumed the same way."""
    directory = tmp_path_factory.mktemp("reference")
    first, _, first_recorder = train_reference(STEPS_PER_EPOCH, GLOBAL_BATCH, epochs=FIRST_EPOCHS)
    first.save_checkpoint(directory / "first.ckpt")

    def resume(source: Path, epochs: int, name: str) -> list[float]:
        recorder = LossRecorder()
        trainer = make_trainer(1, "auto", max_epochs=epochs, callbacks=[recorder])
        trainer.fit(LitGPT(seed=123), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, 1), ckpt_path=source)
        trainer.save_checkpoint(directory / name)
        return recorder.losses

    resumed_losses = resume(directory / "first.ckpt", TOTAL_EPOCHS, "resumed.ckpt")

    topk_recorder = LossRecorder()
    callback = _top_k_callback(str(directory / "topk"))
    trainer = make_trainer(
        1, "auto", max_epochs=TOPK_EPOCHS, callbacks=[topk_recorder, callback], enable_checkpointing=True
    )
    trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, 1))
    last_losses = resume(directory / "topk" / "last.ckpt", TOPK_EPOCHS + 1, "resumed_from_last.ckpt")
    return {
        "dir": directory,
        "first": load_ckpt(directory / "first.ckpt"),
        "first_losses": first_recorder.losses,
        "resumed": load_ckpt(directory / "resumed.ckpt"),
        "resumed_losses": resumed_losses,
        "topk_losses": topk_recorder.losses,
        "topk_names": sorted(os.listdir(directory / "topk")),
        "best_k": sorted(os.path.basename(p) for p in callback.best_k_models),
        "resumed_from_last": load_ckpt(directory / "resumed_from_last.ckpt"),
        "resumed_from_last_losses": last_losses,
    }


@pytest.fixture(scope="module")
def resumed_on_three_ranks(
    first_runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("resumed3")
    ranks = spawn(_resumed_runs, 3, str(first_runs["dir"]), str(directory))
    return {"dir": directory, "ranks": ranks}


def _resume_on_one_device(rank: int, world: int, source: str, out: str) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = make_trainer(1, _strategy("full", "root"), max_epochs=TOTAL_EPOCHS, callbacks=[recorder])
    trainer.fit(LitGPT(seed=123), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, 1), ckpt_path=source)
    trainer.save_checkpoint(out)
    return {"global_step": trainer.global_step, "losses": recorder.losses}


# ------------------------------------------------------------------------------------- helpers
def _hidden(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def _consolidated(src: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{src.name}.consolidated"
    flatshard.consolidate(src, out)
    return load_ckpt(out)


def _assert_same_training_state(ckpt: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert ckpt["global_step"] == expected["global_step"], (
        what,
        ckpt["global_step"],
        expected["global_step"],
    )
    assert ckpt["epoch"] == expected["epoch"], what
    assert ckpt["loops"] == expected["loops"], what
    assert int(ckpt["state_dict"]["model.steps"]) == expected["global_step"], what
    assert_same_weights(ckpt["state_dict"], expected["state_dict"], what)
    assert len(ckpt["optimizer_states"]) == 1, what
    assert_same_optimizer_state(ckpt["optimizer_states"][0], expected["optimizer_states"][0], what)


def _assert_equal_exactly(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual, key=str) == sorted(expected, key=str), (
            where,
            sorted(actual, key=str),
            sorted(expected, key=str),
        )
        for key in expected:
            _assert_equal_exactly(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal_exactly(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


# ------------------------------------------------------------------------------------- (a) save and resume
@pytest.mark.timeout(300)
def test_sharded_save_writes_a_directory_from_every_rank(
    first_runs: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    directory = first_runs["dir"]
    path = directory / "sharded.ckpt"
    assert path.is_dir() and is_sharded_checkpoint(path)
    assert len(list(path.glob("*.distcp"))) == 2, sorted(os.listdir(path))  # one data file per rank
    assert (directory / "full.ckpt").is_file()
    assert _hidden(directory) == [], "temporary files or directories were left behind"
    for rank in first_runs["ranks"]:
        assert rank["sharded"]["global_step"] == FIRST_EPOCHS * STEPS_PER_EPOCH
        torch.testing.assert_close(rank["sharded"]["losses"], reference["first_losses"], **LOSS_TOL)
    # Its contents are the 1-device run's at the same point.
    _assert_same_training_state(_consolidated(path, tmp_path), reference["first"], "sharded save vs 1 device")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["root_from_sharded", "size_from_sharded"])
def test_sharded_directory_resumes_on_three_ranks_with_other_wrap_policies(
    name: str, resumed_on_three_ranks: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    """Saved on 2 ranks (Block units), resumed on 3 (one unit / size-based units): ends like 1 device."""
    path = resumed_on_three_ranks["dir"] / f"{name}.ckpt"
    if name == "root_from_sharded":  # this run saved a directory again, now from 3 ranks
        assert is_sharded_checkpoint(path) and len(list(path.glob("*.distcp"))) == 3
        ckpt = _consolidated(path, tmp_path)
    else:
        assert path.is_file()
        ckpt = load_ckpt(path)
    _assert_same_training_state(ckpt, reference["resumed"], f"{name} x3")
    for rank in resumed_on_three_ranks["ranks"]:
        assert rank[name]["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH
        # Only the second epoch ran, with the losses of the reference's resumed run.
        torch.testing.assert_close(rank[name]["losses"], reference["resumed_losses"], **LOSS_TOL)
    assert _hidden(resumed_on_three_ranks["dir"]) == []


@pytest.mark.timeout(300)
def test_sharded_directory_resumes_on_one_device(
    first_runs: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "resumed1.ckpt"
    (result,) = spawn(_resume_on_one_device, 1, str(first_runs["dir"] / "sharded.ckpt"), str(out))
    assert result["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH
    torch.testing.assert_close(result["losses"], reference["resumed_losses"], **LOSS_TOL)
    _assert_same_training_state(load_ckpt(out), reference["resumed"], "resumed on 1 device")


# ------------------------------------------------------------------------------------- (b) ModelCheckpoint
@pytest.mark.timeout(300)
def test_model_checkpoint_keeps_top_k_and_last_directories(
    first_runs: dict[str, Any], reference: dict[str, Any]
) -> None:
    topk = first_runs["dir"] / "topk"
    names = sorted(os.listdir(topk))
    # exactly top-2 + last remain (the other 4 saves were removed), with the names the 1-device run kept
    assert len(names) == 3 and "last.ckpt" in names, names
    assert names == reference["topk_names"], (names, reference["topk_names"])
    assert _hidden(topk) == [] and _hidden(first_runs["dir"]) == []
    for name in names:
        assert is_sharded_checkpoint(topk / name), f"{name} is not a sharded checkpoint directory"
    for rank in first_runs["ranks"]:
        assert rank["topk"]["best_k"] == reference["best_k"] == sorted(set(names) - {"last.ckpt"})
        assert rank["topk"]["last"] == "last.ckpt"
        torch.testing.assert_close(rank["topk"]["losses"], reference["topk_losses"], **LOSS_TOL)


@pytest.mark.timeout(300)
def test_model_checkpoint_directory_consolidates_into_a_plain_lightning_file(
    first_runs: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    """Every kept directory consolidates to what the 1-device run wrote under that name; loads into LitGPT."""
    for name in reference["topk_names"]:
        ckpt = _consolidated(first_runs["dir"] / "topk" / name, tmp_path)
        expected = load_ckpt(reference["dir"] / "topk" / name)
        _assert_same_training_state(ckpt, expected, name)
        model = LitGPT(seed=123)
        model.load_state_dict(ckpt["state_dict"])  # a plain LightningModule, strict
        assert_same_weights(model.state_dict(), expected["state_dict"], f"{name} loaded into LitGPT")
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).load_state_dict(
            ckpt["optimizer_states"][0]
        )


@pytest.mark.timeout(300)
def test_last_ckpt_directory_resumes(
    resumed_on_three_ranks: dict[str, Any], reference: dict[str, Any]
) -> None:
    """last.ckpt (a directory replaced at every step) resumes on 3 ranks like the 1-device last.ckpt does."""
    ckpt = load_ckpt(resumed_on_three_ranks["dir"] / "root_from_last.ckpt")
    _assert_same_training_state(ckpt, reference["resumed_from_last"], "resumed from last.ckpt x3")
    assert ckpt["global_step"] == (TOPK_EPOCHS + 1) * STEPS_PER_EPOCH
    for rank in resumed_on_three_ranks["ranks"]:
        torch.testing.assert_close(
            rank["root_from_last"]["losses"], reference["resumed_from_last_losses"], **LOSS_TOL
        )


# ------------------------------------------------------------------------------------- (c) sharded == full
@pytest.mark.timeout(300)
def test_consolidated_sharded_save_equals_full_save_key_by_key(
    first_runs: dict[str, Any], tmp_path: Path
) -> None:
    """The same training saved once per state_dict_type: consolidating the directory gives the full file."""
    consolidated = _consolidated(first_runs["dir"] / "sharded.ckpt", tmp_path)
    full = load_ckpt(first_runs["dir"] / "full.ckpt")
    assert sorted(consolidated) == sorted(full)
    for key in full:
        _assert_equal_exactly(consolidated[key], full[key], key)
    assert list(consolidated["state_dict"]) == list(full["state_dict"])  # same key order too
