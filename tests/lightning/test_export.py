"""``flatshard consolidate DIR OUT.safetensors`` on a sharded directory a 2-rank Trainer wrote: the model
weights equal the run's full state dict, tied weights are stored once and restored, ``--prefix model.`` loads
strictly into the inner TinyGPT, and ``--ema`` exports the EMA state a callback saved."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.checkpoint import export as export_module
from flatshard.checkpoint import load_safetensors
from flatshard.cli import main
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT

from .lit_common import LitGPT, make_loader, make_trainer, strip_prefix

safetensors_torch = pytest.importorskip("safetensors.torch")

GLOBAL_BATCH = 4
STEPS = 2
EMA_KEY = "ShardedEMA{'decay': 0.9}"


class SnapshotEMA(Callback):
    """Stands in for an EMA callback: its state holds ``ema_state_dict``, the parameters (under the model's
    state-dict names, a tied one once, no buffers) as they were after the first step."""

    def __init__(self) -> None:
        self.snapshot: dict[str, torch.Tensor] = {}

    @property
    def state_key(self) -> str:
        return EMA_KEY

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1:
            state, _ = flatshard.get_state_dict(pl_module)  # every rank; the full state on rank 0
            self.snapshot = {n: state[n] for n, _ in pl_module.named_parameters()} if state else {}

    def state_dict(self) -> dict[str, Any]:
        return {"ema_state_dict": self.snapshot, "decay": 0.9}


def _train(rank: int, world: int, path: str) -> dict[str, Any]:
    ema = SnapshotEMA()
    strategy = flatshard.FlatShardStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    trainer = make_trainer(world, strategy, max_epochs=1, callbacks=[ema])
    trainer.fit(LitGPT(), make_loader(STEPS, GLOBAL_BATCH, world))
    trainer.save_checkpoint(path)
    full, _ = flatshard.get_state_dict(trainer.lightning_module)
    return {"full": full, "ema": ema.snapshot}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("export") / "sharded.ckpt"
    result = spawn(_train, 2, str(path))[0]
    assert path.is_dir() and result["ema"]
    return {"dir": path, **result}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_dir_exports_the_full_state_dict(
    run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    full: dict[str, torch.Tensor] = run["full"]
    out = tmp_path / "model.safetensors"
    monkeypatch.setattr(export_module, "_BATCH_BYTES", 1000)  # many reads of a few tensors each
    assert main(["consolidate", str(run["dir"]), str(out)]) == 0
    assert "model.head.weight -> model.wte.weight" in capsys.readouterr().out

    restored = load_safetensors(out)
    assert list(full) == list(LitGPT().state_dict()) and sorted(restored) == sorted(full)
    for key, value in full.items():
        assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key
    assert restored["model.head.weight"] is restored["model.wte.weight"]
    assert sorted(safetensors_torch.load_file(out)) == sorted(set(full) - {"model.head.weight"})

    # The consolidated file exports to the same bytes, and flatshard.consolidate picks the format too.
    full_ckpt = flatshard.consolidate(run["dir"], tmp_path / "full.ckpt")
    assert main(["consolidate", str(full_ckpt), str(tmp_path / "from_file.safetensors")]) == 0
    assert (tmp_path / "from_file.safetensors").read_bytes() == out.read_bytes()
    assert flatshard.consolidate(run["dir"], tmp_path / "api.safetensors") == tmp_path / "api.safetensors"
    assert (tmp_path / "api.safetensors").read_bytes() == out.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefix_loads_strictly_into_the_inner_model(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "tinygpt.safetensors"
    assert main(["consolidate", str(run["dir"]), str(out), "--prefix", "model."]) == 0
    model = TinyGPT()
    model.load_state_dict(load_safetensors(out), strict=True)
    assert model.head.weight is model.wte.weight
    for key, value in strip_prefix(run["full"]).items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ema_exports_the_callbacks_weights(run: dict[str, Any], tmp_path: Path, capsys) -> None:
    out = tmp_path / "ema.safetensors"
    assert main(["consolidate", str(run["dir"]), str(out), "--ema", "--prefix", "model."]) == 0
    printed = capsys.readouterr().out
    assert "EMA weights" in printed and "model.steps" in printed, printed
    restored = load_safetensors(out)
    ema = strip_prefix(run["ema"])
    assert "head.weight" not in ema
    for key, value in ema.items():
        assert torch.equal(restored[key], value), key
    assert restored["head.weight"] is restored["wte.weight"]
    assert not torch.equal(restored["wte.weight"], run["full"]["model.wte.weight"])  # not the trained ones
    assert torch.equal(restored["steps"], run["full"]["model.steps"])  # buffers: the checkpoint's
    TinyGPT().load_state_dict(restored, strict=True)
    assert not os.path.exists(tmp_path / "model.safetensors")
