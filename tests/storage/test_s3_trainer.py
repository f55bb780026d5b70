"""The Trainer with checkpoints on a real S3-compatible server (see conftest.py): ``ModelCheckpoint`` writing
sharded directories to ``s3://`` from 2 ranks in the background (``async_save=True``), removing the directory a better one replaces, and
``fit(ckpt_path="s3://...")`` resuming on 4 ranks, ending where one uninterrupted device ends.

Global batch 4 (2 ranks x 2, 4 ranks x 1, 1 device x 4), 3 steps per epoch: 2 epochs on 2 ranks, the third on
4 ranks, against 3 epochs on one device (``strategy="auto"``, see ``tests/lightning/lit_common.py`` for why
the batches match).
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
from tests.lightning.lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    load_ckpt,
    make_loader,
    make_trainer,
    train_reference,
)

from .conftest import S3Server

GLOBAL_BATCH = 4
STEPS_PER_EPOCH = 3
FIRST_EPOCHS, TOTAL_EPOCHS = 2, 3
LOSS_TOL = {"atol": 1e-5, "rtol": 1e-5}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
]


# ------------------------------------------------------------------------------------- in spawned ranks
def _first_run(rank: int, world: int, dirpath: str, cwd: str) -> dict[str, Any]:
    """2 epochs; ModelCheckpoint keeps the newest epoch (top-1 by ``epoch``) and last.ckpt, as directories."""
    os.chdir(cwd)
    callback = ModelCheckpoint(dirpath=dirpath, monitor="epoch", mode="max", save_top_k=1, save_last=True)
    recorder = LossRecorder()
    trainer = make_trainer(
        world,
        # asynchronous saves: written in the background while training goes on
        flatshard.FlatShardStrategy(state_dict_type="sharded", auto_wrap_policy={Block}, async_save=True),
        max_epochs=FIRST_EPOCHS,
        callbacks=[callback, recorder],
        enable_checkpointing=True,
    )
    trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
    return {"best": callback.best_model_path, "last": callback.last_model_path, "losses": recorder.losses}


def _resume(rank: int, world: int, ckpt_path: str, out: str, cwd: str) -> dict[str, Any]:
    """The third epoch on ``world`` ranks from the URL (another init: everything comes from the checkpoint),
    then one full file written to S3."""
    os.chdir(cwd)
    recorder = LossRecorder()
    trainer = make_trainer(
        world, flatshard.FlatShardStrategy(), max_epochs=TOTAL_EPOCHS, callbacks=[recorder]
    )
    trainer.fit(LitGPT(seed=123), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world), ckpt_path=ckpt_path)
    trainer.save_checkpoint(out)
    return {"global_step": trainer.global_step, "losses": recorder.losses}


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One device, 3 epochs without interruption."""
    trainer, _, recorder = train_reference(STEPS_PER_EPOCH, GLOBAL_BATCH, epochs=TOTAL_EPOCHS)
    path = tmp_path_factory.mktemp("reference") / "reference.ckpt"
    trainer.save_checkpoint(path)
    return {"ckpt": load_ckpt(path), "losses": recorder.losses}


@pytest.fixture(scope="module")
def first_run(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("cwd-first")
    dirpath = f"s3://{s3_server.bucket}/trainer-run/ckpts"
    ranks = spawn(_first_run, 2, dirpath, str(cwd))
    return {"dirpath": dirpath, "ranks": ranks, "cwd": cwd}


# ------------------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_model_checkpoint_writes_sharded_directories_to_s3_and_removes_the_replaced_one(
    first_run: dict[str, Any], s3_server: S3Server, reference: dict[str, Any]
) -> None:
    fs = s3_server.fs()
    dirpath = first_run["dirpath"]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(dirpath, refresh=True))
    # epoch=0's directory was replaced by epoch=1's (top-1) and removed through the strategy
    assert names == ["epoch=1-step=6.ckpt", "last.ckpt"], names
    for name in names:
        url = f"{dirpath}/{name}"
        assert is_sharded_checkpoint(url), url
        objects = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True))
        data = [o for o in objects if o.endswith(".distcp")]
        assert objects == sorted([".metadata", "meta.pt", *data]), objects
        assert len(data) == 2, objects  # one data object per rank
    for rank in first_run["ranks"]:
        assert rank["best"] == f"{dirpath}/epoch=1-step=6.ckpt" and rank["last"] == f"{dirpath}/last.ckpt"
        expected = reference["losses"][: FIRST_EPOCHS * STEPS_PER_EPOCH]
        torch.testing.assert_close(rank["losses"], expected, **LOSS_TOL)
    assert sorted(os.listdir(first_run["cwd"])) == [], "a URL was written as a local path"


@pytest.mark.timeout(120)
def test_fit_resumes_from_an_s3_url_on_four_ranks_like_an_uninterrupted_run(
    first_run: dict[str, Any], s3_server: S3Server, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Saved on 2 ranks, resumed on 4 from ``s3://.../last.ckpt``, saved as one full file to S3."""
    out = f"s3://{s3_server.bucket}/trainer-run/resumed.ckpt"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ranks = spawn(_resume, 4, f"{first_run['dirpath']}/last.ckpt", out, str(cwd))
    for rank in ranks:
        assert rank["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH
        expected = reference["losses"][FIRST_EPOCHS * STEPS_PER_EPOCH :]
        torch.testing.assert_close(rank["losses"], expected, **LOSS_TOL)
    with s3_server.fs().open(out, "rb") as f:  # a plain Lightning checkpoint, read with plain torch
        ckpt = torch.load(f, map_location="cpu", weights_only=False)
    expected_ckpt = reference["ckpt"]
    assert ckpt["global_step"] == expected_ckpt["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH
    assert ckpt["epoch"] == expected_ckpt["epoch"]
    assert_same_weights(ckpt["state_dict"], expected_ckpt["state_dict"], "resumed on 4 ranks from S3")
    assert_same_optimizer_state(
        ckpt["optimizer_states"][0], expected_ckpt["optimizer_states"][0], "resumed on 4 ranks from S3"
    )
    assert sorted(os.listdir(cwd)) == [], "a URL was written as a local path"
