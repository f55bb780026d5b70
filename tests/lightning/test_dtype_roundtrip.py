"""Nothing lost: a model whose frozen parameters and buffers hold every dtype ``torch.save`` stores (see
``tests/dtype_cases.py``) goes through every writer on 2 gloo ranks, and each file reads back with
``torch.load(weights_only=True)`` to what ``torch.save`` of the same unsharded model gives, bit for bit:

- ``Trainer(strategy=FlatShardStrategy(...)).save_checkpoint`` (the streamed full save),
- ``fabric.save`` with the Fabric strategy (full),
- ``flatshard.save_checkpoint`` full, and sharded, consolidated offline to one ``.ckpt`` and loaded back.

The frozen parameters are sharded and gathered every step (as bytes where gloo cannot move the dtype; quantized
tensors cannot be parameters of a sharded module and are buffers only). A sharded save of a dtype DCP cannot
store (the bits and quantized dtypes) is refused on every rank, naming the parameter, before anything is
written. Buffers of the packed quantized dtypes (``quint4x2``, ``quint2x4``), which torch has no copy kernel
for, are copied by their bytes.

One spawned run does all the saves; the tests below check its files.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import flatshard
from flatshard.checkpoint import CheckpointError, consolidate
from flatshard.testing import spawn
from tests.dtype_cases import SAVED, dtype_name, same, sample

from .lit_common import make_trainer

WORLD = 2
QUANTIZED = [d for d in SAVED if sample(d).is_quantized]
PACKED = [
    d for d in QUANTIZED if dtype_name(d) in ("quint4x2", "quint2x4")
]  # torch has no copy kernel for them
FROZEN = [d for d in SAVED if d not in QUANTIZED]  # sharded parameters
BUFFERS = [d for d in SAVED if d not in PACKED]
BITS = [d for d in SAVED if dtype_name(d).startswith("bits")]
SHARDED = [d for d in FROZEN if d not in BITS]  # what a torch.distributed.checkpoint directory stores


class Holder(nn.Module):
    """A unit of frozen parameters (one flat parameter per dtype) and buffers, every one of another dtype."""

    def __init__(self, params: list[torch.dtype], buffers: list[torch.dtype]) -> None:
        super().__init__()
        for i, d in enumerate(params):
            p = nn.Parameter(sample(d, (5, 3), seed=i), requires_grad=False)  # 15 elements: padded on 2 ranks
            self.register_parameter(f"p_{dtype_name(d)}", p)
        for i, d in enumerate(buffers):
            self.register_buffer(f"b_{dtype_name(d)}", sample(d, (2, 4), seed=100 + i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # its parameters are gathered all the same


class Net(nn.Module):
    def __init__(self, params: list[torch.dtype], buffers: list[torch.dtype]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.holder = Holder(params, buffers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.holder(x))


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net(FROZEN, BUFFERS)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _reference(params: list[torch.dtype], buffers: list[torch.dtype]) -> dict[str, torch.Tensor]:
    """``torch.save`` of the unsharded model's state dict, read with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(Net(params, buffers).state_dict(), buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def _saves(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # quantized tensors are deprecated, ComplexHalf is experimental
    out = Path(folder)
    # the Trainer's streamed full save, after a step that gathered the frozen parameters
    strategy = flatshard.FlatShardStrategy(auto_wrap_policy={Holder, nn.Linear})
    trainer = make_trainer(world, strategy, max_steps=1)
    trainer.fit(Lit(), DataLoader(TensorDataset(torch.randn(4 * world, 4)), batch_size=4))
    trainer.save_checkpoint(out / "trainer.ckpt")
    # Fabric's full save
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=flatshard.FlatShardFabricStrategy(auto_wrap_policy={Holder}),
    )
    fabric.launch()
    model = fabric.setup_module(Net(FROZEN, BUFFERS))
    model(torch.randn(2, 4)).sum().backward()
    fabric.save(out / "fabric.ckpt", {"model": model, "step": 1})
    # the engine: a full file, a sharded directory loaded back, a sharded save refused
    net = Net(FROZEN, BUFFERS)
    flatshard.shard(net, auto_wrap_policy={Holder})
    net(torch.randn(2, 4)).sum().backward()
    flatshard.save_checkpoint(out / "engine.ckpt", net)
    stored = Net(SHARDED, SHARDED)
    flatshard.shard(stored, auto_wrap_policy={Holder})
    flatshard.save_checkpoint(out / "sharded", stored, state_dict_type="sharded")
    fresh = Net(SHARDED, SHARDED)
    with torch.no_grad():
        for t in [*fresh.holder.parameters(), *fresh.holder.buffers()]:
            t.view(torch.uint8).zero_()  # nothing left of the values: the load brings them back
    flatshard.shard(fresh, auto_wrap_policy={Holder})
    flatshard.load_checkpoint(out / "sharded", fresh)
    loaded, _ = flatshard.get_state_dict(fresh)
    as_bytes = io.BytesIO()  # plain pickling (what the harness returns through) loses the newer dtypes
    torch.save(loaded, as_bytes)
    try:
        flatshard.save_checkpoint(out / "refused", net, state_dict_type="sharded")
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    packed = Net([], PACKED)  # last: see test_packed_quantized_buffers_save_in_full
    flatshard.shard(packed)
    try:
        flatshard.save_checkpoint(out / "packed.ckpt", packed)
        saved = "saved"
    except CheckpointError as err:
        saved = str(err)
    return {"loaded": as_bytes.getvalue(), "refused": refused, "packed": saved}


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("dtypes")
    return folder, spawn(_saves, WORLD, str(folder))


def _same_state(
    got: dict[str, Any], want: dict[str, torch.Tensor], what: str, prefix: str = "", at_least: int = 40
) -> None:
    names = [k for k in want if not k.startswith("lin.")]  # the trained layer changed; the rest did not
    assert len(names) >= at_least, names
    for k in names:
        same(got[prefix + k], want[k], f"{what}: {k}")
    for k in ("lin.weight", "lin.bias"):
        assert got[prefix + k].dtype == torch.float32 and got[prefix + k].shape == want[k].shape, (what, k)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_full_save_keeps_every_dtype(saves: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = saves
    want = _reference(FROZEN, BUFFERS)
    for weights_only in (True, False):
        ckpt = torch.load(folder / "trainer.ckpt", weights_only=weights_only)
        _same_state(ckpt["state_dict"], want, f"Trainer save (weights_only={weights_only})", prefix="net.")
        assert ckpt["global_step"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_full_save_keeps_every_dtype(saves: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = saves
    ckpt = torch.load(folder / "fabric.ckpt", weights_only=True)
    _same_state(ckpt["model"], _reference(FROZEN, BUFFERS), "Fabric save")
    assert ckpt["step"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_full_save_keeps_every_dtype(saves: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = saves
    ckpt = torch.load(folder / "engine.ckpt", weights_only=True)
    _same_state(ckpt["state_dict"], _reference(FROZEN, BUFFERS), "flatshard.save_checkpoint")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_save_consolidates_and_loads_back_every_dtype_it_stores(
    saves: tuple[Path, list[dict[str, Any]]],
) -> None:
    folder, ranks = saves
    want = _reference(SHARDED, SHARDED)
    consolidate(folder / "sharded", folder / "consolidated.ckpt")
    ckpt = torch.load(folder / "consolidated.ckpt", weights_only=True)
    _same_state(ckpt["state_dict"], want, "consolidated sharded save")
    loaded = torch.load(io.BytesIO(ranks[0]["loaded"]), weights_only=True)
    _same_state(loaded, want, "sharded save loaded into a fresh model")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sharded_save_of_a_dtype_dcp_cannot_store_is_refused_before_writing(
    saves: tuple[Path, list[dict[str, Any]]],
) -> None:
    folder, ranks = saves
    for rank in ranks:
        message = rank["refused"]
        assert "holder.p_bits" in message and "torch.bits" in message and "HINT" in message, message
        assert "state_dict_type='full'" in message, message
    assert not (folder / "refused").exists()
    assert not [n for n in os.listdir(folder) if n.startswith(".")]  # no temporary left


@pytest.mark.slow
def test_packed_quantized_buffers_save_in_full(saves: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, ranks = saves
    assert ranks[0]["packed"] == "saved", ranks[0]["packed"]
    ckpt = torch.load(folder / "packed.ckpt", weights_only=True)
    _same_state(ckpt["state_dict"], _reference([], PACKED), "packed quantized buffers", at_least=len(PACKED))
