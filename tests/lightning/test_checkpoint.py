"""Consolidated checkpoints: a plain Lightning file that loads anywhere, and resumes on any world size.

Global batch 6 throughout (2 ranks x 3, 3 ranks x 2, 1 device x 6), 2 steps per epoch. The first run trains
1 epoch and saves at the epoch boundary; every resumed run continues to epoch 2 and must end where an
uninterrupted 1-device run of 2 epochs ends: weights, buffers, optimizer state, step counters, losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import flatshard
import flatshard.testing.models
from flatshard.testing import spawn
from flatshard.testing.models import TinyGPT

from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    fit_and_save,
    load_ckpt,
    make_loader,
    make_trainer,
    strategy_by_name,
    strip_prefix,
    train_reference,
)

GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 2
FIRST_EPOCHS, TOTAL_EPOCHS = 1, 2


class PoisonableGPT(LitGPT):
    """Can put an unpicklable object into its checkpoint, to make a save fail halfway through writing."""

    poison = False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.poison:
            checkpoint["unpicklable"] = lambda: None


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _first_runs(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Train 1 epoch under ddp and flatshard (two wrap modes); each writes ``<name>.ckpt``."""
    results: dict[str, Any] = {}
    for name in ("ddp", "flatshard", "flatshard_block"):
        model = PoisonableGPT()
        trainer = make_trainer(world, strategy_by_name(name), max_epochs=FIRST_EPOCHS)
        trainer.fit(model, make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world))
        path = os.path.join(out_dir, f"{name}.ckpt")
        trainer.save_checkpoint(path)
        results[name] = {"global_step": trainer.global_step, "files": sorted(os.listdir(out_dir))}
        if name == "flatshard":
            # Saving over it again fails while pickling (on rank 0, the writer): the old file must survive.
            before = _sha256(path) if rank == 0 else None
            model.poison = True
            try:
                trainer.save_checkpoint(path)
                failed = None
            except Exception as err:
                failed = type(err).__name__
                trainer.strategy.barrier()  # the barrier the failed save skipped; the other ranks wait in it
            model.poison = False
            results["failed_save"] = {
                "raised": failed,
                "unchanged": before == _sha256(path) if rank == 0 else None,
                "files": sorted(os.listdir(out_dir)),
            }
    return results


# (resumed run, strategy it resumes under, checkpoint it resumes from)
RESUMES = [
    ("flatshard_from_flatshard", "flatshard", "flatshard.ckpt"),
    ("flatshard_block_from_ddp", "flatshard_block", "ddp.ckpt"),
    ("grad_op_from_flatshard_block", "flatshard_grad_op", "flatshard_block.ckpt"),
    ("flatshard_from_auto", "flatshard", "auto.ckpt"),  # written by strategy="auto" on 1 device
]


def _resumed_runs(rank: int, world: int, sources: dict[str, str], out_dir: str) -> dict[str, Any]:
    return {
        name: fit_and_save(
            world,
            strategy_by_name(strategy),
            LitGPT(),
            make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world),
            TOTAL_EPOCHS,
            os.path.join(out_dir, f"{name}.ckpt"),
            ckpt_path=sources[source],
        )
        for name, strategy, source in RESUMES
    }


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("first")
    ranks = spawn(_first_runs, 2, str(directory))
    return {"dir": directory, "ranks": ranks}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """1 device, 2 epochs, no interruption; plus its state after the first epoch."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    trainer, _, recorder = train_reference(STEPS_PER_EPOCH, GLOBAL_BATCH, epochs=TOTAL_EPOCHS)
    trainer.save_checkpoint(directory / "full.ckpt")
    first, _, _ = train_reference(STEPS_PER_EPOCH, GLOBAL_BATCH, epochs=FIRST_EPOCHS)
    first.save_checkpoint(directory / "first.ckpt")
    return {
        "ckpt": load_ckpt(directory / "full.ckpt"),
        "first": load_ckpt(directory / "first.ckpt"),
        "first_path": directory / "first.ckpt",
        "losses": recorder.losses,
    }


@pytest.fixture(scope="module")
def resumed_on_three_ranks(
    first_runs: dict[str, Any], uninterrupted: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("resumed3")
    sources = {source: str(first_runs["dir"] / source) for _, _, source in RESUMES}
    sources["auto.ckpt"] = str(uninterrupted["first_path"])
    ranks = spawn(_resumed_runs, 3, sources, str(directory))
    return {"ranks": ranks, "ckpt": {name: load_ckpt(directory / f"{name}.ckpt") for name, _, _ in RESUMES}}


def _assert_ends_like_uninterrupted(ckpt: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    assert ckpt["global_step"] == reference["ckpt"]["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH, what
    assert ckpt["epoch"] == reference["ckpt"]["epoch"], what
    assert int(ckpt["state_dict"]["model.steps"]) == TOTAL_EPOCHS * STEPS_PER_EPOCH, what
    assert_same_weights(ckpt["state_dict"], reference["ckpt"]["state_dict"], what)
    assert_same_optimizer_state(ckpt["optimizer_states"][0], reference["ckpt"]["optimizer_states"][0], what)


@pytest.mark.timeout(300)
def test_a_failed_save_leaves_the_previous_checkpoint_intact(first_runs: dict[str, Any]) -> None:
    """trainer.save_checkpoint over an existing file fails while writing: the old file is untouched (written
    to a temporary file and renamed only when complete), no temporary file is left, and it still resumes."""
    writer = first_runs["ranks"][0]["failed_save"]
    assert writer["raised"] is not None, "saving an unpicklable checkpoint did not fail"
    assert writer["unchanged"] is True
    assert writer["files"] == ["ddp.ckpt", "flatshard.ckpt"]
    ckpt = torch.load(first_runs["dir"] / "flatshard.ckpt", map_location="cpu", weights_only=False)
    assert "unpicklable" not in ckpt and ckpt["global_step"] == STEPS_PER_EPOCH


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["flatshard", "flatshard_block"])
def test_checkpoint_is_a_plain_lightning_file(name: str, first_runs: dict[str, Any]) -> None:
    path = first_runs["dir"] / f"{name}.ckpt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    for key in (
        "state_dict",
        "optimizer_states",
        "epoch",
        "global_step",
        "loops",
        "pytorch-lightning_version",
    ):
        assert key in ckpt, (key, sorted(ckpt))
    assert ckpt["global_step"] == STEPS_PER_EPOCH
    # Original names, shapes and dtypes; the tied head is stored under both names.
    state = strip_prefix(ckpt["state_dict"])
    expected = TinyGPT().state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype, key
        assert state[key].device.type == "cpu", key
    torch.testing.assert_close(state["head.weight"], state["wte.weight"], atol=0, rtol=0)
    model = TinyGPT()
    model.load_state_dict(state, strict=True)
    assert model.head.weight is model.wte.weight
    assert int(model.steps) == STEPS_PER_EPOCH
    # The same training under ddp wrote the same weights.
    assert_same_weights(ckpt["state_dict"], load_ckpt(first_runs["dir"] / "ddp.ckpt")["state_dict"], name)
    # Written atomically: no temporary files are left beside it (rank 0 listed the folder after saving).
    assert first_runs["ranks"][0]["flatshard_block"]["files"] == [
        "ddp.ckpt",
        "flatshard.ckpt",
        "flatshard_block.ckpt",
    ]


@pytest.mark.timeout(300)
def test_checkpoint_loads_in_a_process_without_flatshard(first_runs: dict[str, Any], tmp_path: Path) -> None:
    """``import flatshard`` is made impossible; TinyGPT's definition is executed from its file with runpy."""
    script = textwrap.dedent(
        """
        import json, runpy, sys
        sys.modules["flatshard"] = None  # any import of flatshard (also by unpickling) now fails
        import torch
        ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
        TinyGPT = runpy.run_path(sys.argv[2])["TinyGPT"]
        model = TinyGPT()
        prefix = "model."
        model.load_state_dict({k[len(prefix):]: v for k, v in ckpt["state_dict"].items()}, strict=True)
        loaded = [m for m, mod in sys.modules.items() if m.split(".")[0] == "flatshard" and mod is not None]
        assert not loaded, loaded
        print(json.dumps({k: float(v.double().sum()) for k, v in model.state_dict().items()}))
        """
    )
    path = first_runs["dir"] / "flatshard.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), flatshard.testing.models.__file__],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    sums = json.loads(proc.stdout.strip().splitlines()[-1])
    state = strip_prefix(load_ckpt(path)["state_dict"])
    assert sums == pytest.approx({k: float(v.double().sum()) for k, v in state.items()}, rel=1e-12, abs=1e-12)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["flatshard", "flatshard_block"])
def test_optimizer_state_is_plain_and_matches_ddp(
    name: str, first_runs: dict[str, Any], uninterrupted: dict[str, Any]
) -> None:
    mine = load_ckpt(first_runs["dir"] / f"{name}.ckpt")["optimizer_states"]
    ddp = load_ckpt(first_runs["dir"] / "ddp.ckpt")["optimizer_states"]
    assert len(mine) == len(ddp) == 1
    state = mine[0]
    # Plain format: integer indices 0..n-1 in param_groups order, full-shape tensors.
    params = list(LitGPT().parameters())
    assert state["param_groups"][0]["params"] == list(range(len(params)))
    assert sorted(state["state"]) == list(range(len(params)))
    for idx, p in enumerate(params):
        assert sorted(state["state"][idx]) == ["exp_avg", "exp_avg_sq", "step"]
        assert state["state"][idx]["exp_avg"].shape == p.shape
        assert float(state["state"][idx]["step"]) == STEPS_PER_EPOCH
    assert_same_optimizer_state(state, ddp[0], f"{name} vs ddp")
    assert_same_optimizer_state(state, uninterrupted["first"]["optimizer_states"][0], f"{name} vs 1 device")
    # A plain torch optimizer accepts it as is.
    model = TinyGPT()
    model.load_state_dict(strip_prefix(load_ckpt(first_runs["dir"] / f"{name}.ckpt")["state_dict"]))
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).load_state_dict(state)


@pytest.mark.timeout(300)
def test_resume_on_one_device_with_strategy_auto(
    first_runs: dict[str, Any], uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    recorder = LossRecorder()
    trainer = make_trainer(1, "auto", max_epochs=TOTAL_EPOCHS, callbacks=[recorder])
    trainer.fit(
        LitGPT(),
        make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, 1),
        ckpt_path=first_runs["dir"] / "flatshard.ckpt",
    )
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    _assert_ends_like_uninterrupted(load_ckpt(tmp_path / "resumed.ckpt"), uninterrupted, "auto x1 resumed")
    torch.testing.assert_close(
        recorder.losses, uninterrupted["losses"][STEPS_PER_EPOCH:], atol=1e-5, rtol=1e-5
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _, _ in RESUMES])
def test_resume_on_three_ranks(
    name: str, resumed_on_three_ranks: dict[str, Any], uninterrupted: dict[str, Any]
) -> None:
    """Saved on 2 ranks (flatshard or ddp) or 1 device (auto), resumed under flatshard on 3 ranks with any
    wrap policy."""
    _assert_ends_like_uninterrupted(resumed_on_three_ranks["ckpt"][name], uninterrupted, f"{name} x3")
    for info in (r[name] for r in resumed_on_three_ranks["ranks"]):
        assert info["global_step"] == TOTAL_EPOCHS * STEPS_PER_EPOCH
        # Only the second epoch ran, with the losses of the uninterrupted run's second epoch.
        torch.testing.assert_close(
            info["losses"], uninterrupted["losses"][STEPS_PER_EPOCH:], atol=1e-5, rtol=1e-5
        )
