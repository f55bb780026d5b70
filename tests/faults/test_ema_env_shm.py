"""Faults around three things that must not lose or leave anything: checkpoints saved while an EMA is swapped
in, malformed ``FLATSHARD_*`` environment variables, and ``/dev/shm`` after a rank is killed.

- **EMA** (``ShardedEMA(swap_eval=True)``, 2 gloo ranks, the real Trainer): a callback saves in
  ``on_validation_epoch_end`` of epoch 0 (the EMA swapped in), again inside ``flatshard.unshard_params``, and
  ``ModelCheckpoint`` saves on ``val_loss``; with ``async_save`` a save is still being written when validation
  swaps the EMA in. Every checkpoint must hold, under ``state_dict``, the training weights of the end of epoch 0
  (recorded before validation) and the EMA under its own key; the live (swapped-in) weights are bit for bit the
  same after the saves; resuming from the validation checkpoints ends epoch 1 where the uninterrupted run did.
  The same through Fabric (``ema.swapped_in()`` around ``fabric.save``) and on one device (whole parameters).
- **Environment**: ``FLATSHARD_SHM`` with negative numbers, words, units and blanks fails at ``shard()`` with an
  error naming the variable and its value, and a hint (``FLATSHARD_DESYNC_TIMEOUT``: ``test_desync_faults``).
- **/dev/shm**: a driver process starts 2 ranks (forked) that train and gather full state in a loop, and kills a
  rank (or both) with SIGKILL at a random moment, 16 times; no ``flatshard-*`` name of those ranks may remain.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import flatshard
from flatshard.engine.transport import memory, shm
from flatshard.lightning import ShardedEMA
from flatshard.testing import spawn
from flatshard.testing.harness import _context, find_free_port
from flatshard.testing.models import Block, TinyGPT
from tests.distributed.test_dcp_interop import _loss
from tests.lightning.lit_common import LitGPT, load_ckpt, make_loader, make_trainer

DECAY, STEPS, GLOBAL_BATCH = 0.5, 2, 4
KINDS = ("full", "sharded", "async")
EXACT = {"atol": 0.0, "rtol": 0.0}


# ---------------------------------------------------------------------------------------------- EMA
class LitVal(LitGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model.loss(batch[0], batch[1]), sync_dist=True)


def _ema_callback(trainer: L.Trainer) -> ShardedEMA:
    (cb,) = [c for c in trainer.callbacks if isinstance(c, ShardedEMA)]  # type: ignore[attr-defined]
    return cb


class SaveDuringValidation(Callback):
    """Records the training weights and the EMA after epoch 0's last step, then saves in its validation."""

    def __init__(self, out: str, kind: str) -> None:
        self.out, self.kind = out, kind
        self.record: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.current_epoch == 0 and trainer.global_step == STEPS:
            ema = _ema_callback(trainer).ema
            assert ema is not None
            self.record["training"] = flatshard.get_state_dict(pl_module)[0]  # nothing swapped yet
            self.record["ema"] = ema.full_state_dict()
            if self.kind == "async":  # still being written when validation swaps the EMA in
                trainer.save_checkpoint(os.path.join(self.out, "async-inflight.ckpt"))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ema = _ema_callback(trainer).ema
        if trainer.current_epoch != 0 or ema is None:
            return
        live = [p.detach().clone() for p in pl_module.parameters()]
        swapped = ema.swapped
        trainer.save_checkpoint(os.path.join(self.out, f"{self.kind}-val.ckpt"))
        with flatshard.unshard_params(pl_module):
            trainer.save_checkpoint(os.path.join(self.out, f"{self.kind}-unshard.ckpt"))
        same = all(torch.equal(a, p.detach()) for a, p in zip(live, pl_module.parameters(), strict=True))
        self.record["swapped_and_unchanged"] = swapped and ema.swapped and same


def _strategy(kind: str) -> flatshard.FlatShardStrategy:
    return flatshard.FlatShardStrategy(
        state_dict_type="full" if kind == "full" else "sharded",
        async_save=kind == "async",
        auto_wrap_policy={Block},
    )


def _fit(world: int, kind: str, out: str, ckpt_path: str | None = None) -> dict[str, Any]:
    ema = ShardedEMA(decay=DECAY)
    probe = SaveDuringValidation(out, kind)
    callbacks: list[Callback] = [ema, probe]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(os.path.join(out, f"{kind}-mc"), "{epoch}", monitor="val_loss", save_top_k=-1)
        )
    trainer = make_trainer(
        world, _strategy(kind), max_epochs=2, callbacks=callbacks, enable_checkpointing=True
    )
    model = LitVal()
    trainer.fit(
        model,
        make_loader(STEPS, GLOBAL_BATCH, world),
        make_loader(1, GLOBAL_BATCH, world),
        ckpt_path=ckpt_path,
    )
    assert ema.ema is not None
    final = {"weights": flatshard.get_state_dict(model)[0], "ema": ema.ema.full_state_dict()}
    return {**probe.record, "final": final}


def _trainer_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = {kind: _fit(world, kind, out) for kind in KINDS}
    for kind in ("full", "sharded"):
        runs[f"{kind}-resumed"] = _fit(
            world, kind, os.path.join(out, "resumed"), os.path.join(out, f"{kind}-val.ckpt")
        )
    runs["fabric"] = _fabric_run(world, out)
    return runs


def _fabric_run(world: int, out: str) -> dict[str, Any]:
    """Fabric, sharded: ``fabric.save`` inside ``ema.swapped_in()`` keeps the training weights under "model"."""
    strategy = flatshard.FlatShardFabricStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = flatshard.EMA(model.module, DECAY)
    for step in range(STEPS):
        fabric.backward(_loss(model, step, fabric.global_rank, world))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    training = flatshard.get_state_dict(model.module)[0]
    with ema.swapped_in():
        live = [p.detach().clone() for p in model.parameters()]
        state = {"model": model, "optimizer": optimizer, "ema": ema.sharded_state_dict()}
        fabric.save(os.path.join(out, "fabric.ckpt"), state)
        same = all(torch.equal(a, p.detach()) for a, p in zip(live, model.parameters(), strict=True))
    return {"training": training, "swapped_and_unchanged": same}


def _assert_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert sorted(actual) == sorted(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, **EXACT, msg=lambda m, k=key: f"{what}: {k}: {m}")


def _full_file(path: Path, tmp: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` as one full file (a sharded directory is consolidated first)."""
    if path.is_dir():
        path = Path(flatshard.consolidate(path, tmp / f"{path.parent.name}-{path.name}.full"))
    return load_ckpt(path)


def _saved_ema(ckpt: dict[str, Any]) -> dict[str, Any]:
    states = [v for k, v in ckpt["callbacks"].items() if k.startswith("ShardedEMA")]
    assert len(states) == 1, sorted(ckpt["callbacks"])
    return states[0]["ema_state_dict"]  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoints_saved_with_the_ema_swapped_in_hold_the_training_weights(tmp_path: Path) -> None:
    runs = spawn(_trainer_runs, 2, str(tmp_path))[0]
    for kind in KINDS:
        run = runs[kind]
        assert run["swapped_and_unchanged"], f"{kind}: saving changed the swapped-in weights"
        saved = [
            tmp_path / f"{kind}-val.ckpt",
            tmp_path / f"{kind}-unshard.ckpt",
            tmp_path / f"{kind}-mc" / "epoch=0.ckpt",
        ]
        if kind == "async":
            saved.append(tmp_path / "async-inflight.ckpt")
        for path in saved:
            ckpt = _full_file(path, tmp_path)
            _assert_state(ckpt["state_dict"], run["training"], f"{path.name}: state_dict")
            _assert_state(_saved_ema(ckpt), run["ema"], f"{path.name}: EMA")
    for kind in ("full", "sharded"):  # resumed from the checkpoint saved inside validation
        done, resumed = runs[kind]["final"], runs[f"{kind}-resumed"]["final"]
        _assert_state(resumed["weights"], done["weights"], f"{kind}: resumed weights")
        for key, value in done["ema"].items():
            torch.testing.assert_close(resumed["ema"][key], value, atol=1e-6, rtol=1e-6, msg=key)
    fabric = runs["fabric"]
    assert fabric["swapped_and_unchanged"]
    ckpt = load_ckpt(flatshard.consolidate(tmp_path / "fabric.ckpt", tmp_path / "fabric-full.ckpt"))
    _assert_state(ckpt["state_dict"], fabric["training"], "fabric: model")


def test_a_save_with_the_ema_swapped_in_keeps_the_training_weights_on_one_device(tmp_path: Path) -> None:
    """Whole parameters (one device; DDP alike): Lightning reads ``pl_module.state_dict()`` itself."""
    torch.manual_seed(0)
    probe = _OneDeviceProbe(str(tmp_path / "one.ckpt"))
    trainer = make_trainer(1, "auto", max_epochs=1, callbacks=[ShardedEMA(decay=DECAY), probe])
    trainer.fit(LitVal(), make_loader(STEPS, GLOBAL_BATCH, 1), make_loader(1, GLOBAL_BATCH, 1))
    assert probe.unchanged
    ckpt = load_ckpt(tmp_path / "one.ckpt")
    _assert_state(ckpt["state_dict"], probe.training, "state_dict")
    _assert_state(_saved_ema(ckpt), probe.ema, "EMA")


class _OneDeviceProbe(Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.training: dict[str, Any] = {}
        self.ema: dict[str, Any] = {}
        self.unchanged = False

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ema = _ema_callback(trainer).ema
        assert ema is not None and ema.swapped
        live = {k: v.clone() for k, v in pl_module.state_dict().items()}
        ema.swap()  # the training weights, and the EMA, as they are now
        self.training = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.ema = ema.full_state_dict()
        ema.swap()
        trainer.save_checkpoint(self.path)
        self.unchanged = ema.swapped and all(
            torch.equal(v, pl_module.state_dict()[k]) for k, v in live.items()
        )


# ---------------------------------------------------------------------------------------------- environment
BAD_VALUES = ["-1", "-5", "yes", "true", "on", "60s", "2.5", "", " 1", "1e3", "2"]


def test_a_malformed_shm_switch_fails_at_shard_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "FLATSHARD_SHM"
    for value in BAD_VALUES:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}") + ".*HINT:") as err:
            flatshard.shard(torch.nn.Linear(4, 4))
        assert "could not convert" not in str(err.value)
    for value in ("0", "1"):  # accepted where they are read, too
        monkeypatch.setenv(name, value)
        flatshard.shard(torch.nn.Linear(4, 4))
    monkeypatch.setenv(name, "60s")  # and refused where it is read, not only at shard()
    with pytest.raises(ValueError, match=rf"{name}='60s'"):
        shm.exchange_segments(None, 4096, "test", possible=True, open_peers=True, info={})


def test_the_start_method_variable_and_the_threads_argument_are_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLATSHARD_TEST_START_METHOD", "fork")
    with pytest.raises(ValueError, match=r"FLATSHARD_TEST_START_METHOD='fork'.*HINT:"):
        _context(None)
    with pytest.raises(ValueError, match=r"Prefaulter\(threads=0\).*HINT:"):
        memory.Prefaulter(threads=0)


# ---------------------------------------------------------------------------------------------- /dev/shm
KILLS = 16
PREFIX = "flatshard-"


def _victim(rank: int, port: int, iterations: int, phase: Any) -> None:
    """One rank: train a 2-unit model and gather its full state, ``iterations`` times (shared memory for both).
    A survivor of its peer's kill fails in a collective: that is expected, and quiet."""
    torch.set_num_threads(1)
    try:
        phase[rank] = 1
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=20),
        )
        phase[rank] = 2
        torch.manual_seed(0)
        model = flatshard.shard(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
            auto_wrap_policy={torch.nn.Linear},
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(iterations):
            phase[rank] = 3 + i
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            flatshard.get_state_dict(model, opt)
        dist.destroy_process_group()
    except Exception:
        os._exit(1)
    os._exit(0)


def _names_of(pids: set[int]) -> list[str]:
    """``/dev/shm`` names of flatshard segments created by ``pids`` (``flatshard-<kind>-<pid>-<random>``)."""
    out = []
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) == 4 and parts[2].isdigit() and int(parts[2]) in pids:
            out.append(name)
    return out


def kill_driver(kills: int, iterations: int, seed: int) -> dict[str, Any]:
    """Run in a process of its own: one calibration run, then runs killed at random moments until ``kills`` of
    them killed a rank that was still running."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # nothing computed here yet: the ranks fork cheaply, torch already imported
    rng = random.Random(seed)
    report: dict[str, Any] = {"kills": [], "left": [], "missed": 0}

    def run(delay: float | None, victims: tuple[int, ...]) -> float:
        phase = ctx.Array("i", 2)
        port = find_free_port()
        procs = [ctx.Process(target=_victim, args=(r, port, iterations, phase)) for r in range(2)]
        start = time.monotonic()
        for p in procs:
            p.start()
        if delay is not None:
            time.sleep(delay)
            at = list(phase)
            hit = [r for r in victims if procs[r].is_alive()]
            for r in hit:
                procs[r].kill()  # SIGKILL
            if hit:
                report["kills"].append({"victims": hit, "delay": round(delay, 3), "phase": at})
            else:
                report["missed"] += 1  # the victims had finished already
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():  # a survivor still waiting: killed too
                p.kill()
                p.join()
        elapsed = time.monotonic() - start
        left = _names_of({p.pid for p in procs if p.pid is not None})
        report["left"] += left
        for name in left:  # what the old code leaked: do not leave it for others
            os.unlink(os.path.join("/dev/shm", name))
        return elapsed

    span = run(None, ())
    report["calibration_s"] = round(span, 3)
    for i in range(2 * kills):
        if len(report["kills"]) >= kills:
            break
        run(rng.uniform(0.0, span), ((0, 1), (0,), (1,))[i % 3])
    return report


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or shm._futex() is None, reason="the transport needs Linux x86-64"
)
def test_no_flatshard_name_survives_a_killed_rank(tmp_path: Path) -> None:
    code = (
        "import json, sys; from tests.faults.test_ema_env_shm import kill_driver; "
        f"print(json.dumps(kill_driver({KILLS}, 6, {random.randrange(1 << 30)})))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its ranks die with it if it times out
    )
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err.decode()[-4000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert len(report["kills"]) == KILLS, report
    assert any(min(kill["phase"]) >= 3 for kill in report["kills"]), (
        report
    )  # some kills hit the training loop
    assert report["left"] == [], report
