"""Sharded checkpoints: written on one layout, loaded on another, equal to the unsharded reference.

Every case trains an unsharded reference and a sharded copy on the same global batches, saves the sharded
one as a directory, consolidates it offline, loads it on another world size / wrap policy / strategy, and
checks: the consolidated file equals the reference's plain ``state_dict()`` / ``optimizer.state_dict()``,
and training resumed from the directory matches the reference trained straight through.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.checkpoint import CheckpointError
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
GLOBAL = 12  # global batch, divisible by every world size used here (1, 2, 3, 4)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = make_batch(step, GLOBAL)
    per = GLOBAL // world
    return idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


def _train(model, opt, rank, world, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = _batch(step, rank, world)
        loss = model.loss(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(steps: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ref = TinyGPT()
    opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    _train(ref, opt, 0, 1, steps)
    return ref, opt


def _shard(model: torch.nn.Module, layout: str) -> None:
    if layout == "block":
        flatshard.shard(model, auto_wrap_policy={Block})
    elif layout == "size":
        flatshard.shard(model, auto_wrap_policy=200)
    elif layout == "root":
        flatshard.shard(model)
    elif layout == "grad_op":
        flatshard.shard(model, sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block})
    elif layout == "no_shard":
        flatshard.shard(model, sharding_strategy="NO_SHARD")
    else:  # pragma: no cover
        raise AssertionError(layout)


def _writer(rank: int, world: int, ckpt: str, layout: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    _shard(model, layout)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    # the average of per-rank losses equals the global loss only for equal per-rank batches
    _train(model, opt, rank, world, 3)
    flatshard.save_checkpoint(ckpt, model, opt, state_dict_type="sharded", extra={"step": 3})


def _resumer(rank: int, world: int, ckpt: str, layout: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = TinyGPT()
    _shard(model, layout)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    extra = flatshard.load_checkpoint(ckpt, model, opt)
    losses = _train(model, opt, rank, world, 2, start=3)
    full, optim = flatshard.get_state_dict(model, opt)
    return {"extra": extra, "losses": losses, "model": full, "optim": optim}


def _close(a, b, tol=1e-5):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert (a.float() - b.float()).abs().max().item() <= tol if a.numel() else True
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (sorted(a, key=str), sorted(b, key=str))
        for k in a:
            _close(a[k], b[k], tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y, tol)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize(
    ("save_world", "save_layout", "load_world", "load_layout"),
    [
        (2, "block", 4, "size"),
        pytest.param(4, "size", 1, "root", marks=pytest.mark.slow),
        pytest.param(2, "grad_op", 3, "block", marks=pytest.mark.slow),
        pytest.param(3, "no_shard", 2, "block", marks=pytest.mark.slow),
    ],
)
def test_sharded_checkpoint_reshards_and_consolidates(
    tmp_path: Path, save_world, save_layout, load_world, load_layout
):
    ckpt = str(tmp_path / "ckpt")
    spawn(_writer, save_world, ckpt, save_layout)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary directory may be left behind"

    ref, ref_opt = _reference(3)
    out = tmp_path / "full.ckpt"
    flatshard.consolidate(ckpt, out)
    full = torch.load(out, weights_only=False)
    assert full["step"] == 3
    _close(full["state_dict"], ref.state_dict())
    _close(full["optimizer_states"][0], ref_opt.state_dict())

    results = spawn(_resumer, load_world, ckpt, load_layout)
    ref_losses = _train(ref, ref_opt, 0, 1, 2, start=3)
    assert results[0]["extra"] == {"step": 3}
    # each rank's loss is on its slice; their mean is the global loss
    resumed = [sum(r["losses"][i] for r in results) / load_world for i in range(2)]
    assert max(abs(a - b) for a, b in zip(resumed, ref_losses)) < 1e-5, (resumed, ref_losses)
    _close(results[0]["model"], ref.state_dict())
    _close(results[0]["optim"], ref_opt.state_dict())


def _write_both(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _train(model, opt, rank, world, 2)
    flatshard.save_checkpoint(f"{root}/full.ckpt", model, opt, state_dict_type="full")
    flatshard.save_checkpoint(f"{root}/dir", model, opt, state_dict_type="sharded")


def test_full_and_sharded_equivalent(tmp_path: Path):
    """A full file and a sharded directory of the same run consolidate to identical checkpoints."""
    spawn(_write_both, 2, str(tmp_path))
    a = torch.load(tmp_path / "full.ckpt", weights_only=False)
    flatshard.consolidate(tmp_path / "dir", tmp_path / "cons.ckpt")
    b = torch.load(tmp_path / "cons.ckpt", weights_only=False)
    _close(a, b, tol=0.0)


def _damaged_loader(rank: int, world: int, ckpt: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        flatshard.load_checkpoint(ckpt, model, opt)
        error = None
    except CheckpointError as err:
        error = str(err)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return {"error": error, "unchanged": unchanged, "opt_state": len(opt.state)}


def _write_other_model(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    model = TinyGPT(d_model=16)
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded")


def _write_future_version(rank: int, world: int, path: str) -> None:
    from flatshard.checkpoint import directory as sharded

    torch.set_num_threads(1)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded.FORMAT_VERSION += 1  # this process only: pretend a newer flatshard wrote it
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded")


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    spawn(_writer, 2, str(path), "block")
    return path


@pytest.mark.slow  # tests/faults/test_damaged_checkpoints.py refuses damaged directories in the quick tier
@pytest.mark.parametrize("damage", ["truncate", "missing_shard", "no_metadata", "wrong_model", "version"])
def test_damaged_sharded_checkpoint_fails_before_any_change(
    tmp_path: Path, good_checkpoint: Path, damage: str
):
    ckpt = tmp_path / "ckpt"
    if damage == "wrong_model":
        spawn(_write_other_model, 2, str(ckpt))
    elif damage != "version":
        shutil.copytree(good_checkpoint, ckpt)
    data = sorted(ckpt.glob("*.distcp"))
    if damage == "truncate":
        with open(data[-1], "r+b") as f:
            f.truncate(max(1, data[-1].stat().st_size // 2))
        expected = "truncated"
    elif damage == "missing_shard":
        data[0].unlink()
        expected = "missing"
    elif damage == "no_metadata":
        (ckpt / ".metadata").unlink()
        expected = "no .metadata"
    elif damage == "wrong_model":
        expected = "shape"
    else:
        spawn(_write_future_version, 2, str(ckpt))
        from flatshard.checkpoint.directory import FORMAT_VERSION

        expected = f"format version {FORMAT_VERSION + 1}"
    results = spawn(_damaged_loader, 2, str(ckpt))
    for r in results:
        assert r["error"] is not None and expected in r["error"] and str(ckpt) in r["error"], r["error"]
        assert r["unchanged"] and r["opt_state"] == 0


def _write_wide(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = flatshard.shard(
        nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]), auto_wrap_policy={nn.Linear}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    opt.step()
    flatshard.save_checkpoint(f"{root}/full.ckpt", model, opt, state_dict_type="full")
    flatshard.save_checkpoint(f"{root}/dir", model, opt, state_dict_type="sharded")


def _consolidate_measured(rank: int, world: int, root: str, batch_bytes: int) -> float:
    # the module (the package's name ``consolidate`` is the function)
    consolidate_module = importlib.import_module("flatshard.checkpoint.consolidate")
    consolidate_module.BATCH_BYTES = batch_bytes
    # Blocks of 1 MiB and more come from mappings of their own and go back when freed, in both runs: glibc's
    # moving threshold would otherwise keep freed batches in the heap, more or less of them from run to run.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    flatshard.consolidate(f"{root}/dir", f"{root}/cons-{batch_bytes}.ckpt")
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return (peak - before) / 1024


@pytest.mark.slow
def test_consolidate_streams_the_file_one_batch_at_a_time(tmp_path: Path) -> None:
    """``flatshard consolidate`` writes each tensor into the file as it is read (batches of BATCH_BYTES): the
    process holds about one batch, not the whole state, and the file equals the full save of the same state.
    Measured in fresh processes against reading everything in one batch, which holds the whole state."""
    spawn(_write_wide, 2, str(tmp_path))
    total = (tmp_path / "full.ckpt").stat().st_size / 2**20  # 72 MiB: weights and AdamW's two states
    batched = spawn(_consolidate_measured, 1, str(tmp_path), 8 << 20)[0]
    whole = spawn(_consolidate_measured, 1, str(tmp_path), 1 << 40)[0]
    assert whole - batched > 0.6 * total, (batched, whole, total)
    a = torch.load(tmp_path / "full.ckpt", weights_only=True)
    for name in (f"cons-{8 << 20}.ckpt", f"cons-{1 << 40}.ckpt"):
        _close(a, torch.load(tmp_path / name, weights_only=True), tol=0.0)
