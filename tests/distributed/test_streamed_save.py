"""``flatshard.save_checkpoint`` with full state writes the file as the units are gathered (see [Note: streamed full
saves]): the file holds what ``get_state_dict`` returns, ``torch.load(weights_only=True)`` reads it, it resumes on
another world size, rank 0 holds about one unit of gathered state at a time, and a write failing midway fails
the save on every rank, leaving the previous file whole and no temporary behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.checkpoint.errors import CheckpointError
from flatshard.testing import spawn

WIDTH, DEPTH = 1024, 6  # 4 MiB per unit of weights; 12 MiB per unit with AdamW's two states


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)], nn.LayerNorm(WIDTH))


def _trained(rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = flatshard.shard(_model(), auto_wrap_policy={nn.Linear})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, WIDTH, generator=g)[4 * rank : 4 * rank + 4]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _save(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = _trained(rank, world)
    path = Path(folder) / "full.ckpt"
    with open("/proc/self/clear_refs", "w") as f:  # the peak of the save alone
        f.write("5")
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    flatshard.save_checkpoint(path, model, opt, extra={"step": 2})
    extra_mib = _hwm_mib() - before
    expected, expected_optim = flatshard.get_state_dict(model, opt)
    return {"extra_mib": extra_mib, "model": expected, "optim": expected_optim}


def _resume(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = flatshard.shard(
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)], nn.LayerNorm(WIDTH)),
        auto_wrap_policy={nn.Linear},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = flatshard.load_checkpoint(Path(folder) / "full.ckpt", model, opt)
    state, optim = flatshard.get_state_dict(model, opt)
    return {"extra": extra, "model": state, "optim": optim}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_streamed_full_save_is_the_full_state_and_resumes_elsewhere(tmp_path: Path) -> None:
    saved = spawn(_save, 2, str(tmp_path))
    ckpt = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert ckpt["step"] == 2
    assert _equal(ckpt["state_dict"], saved[0]["model"])
    assert _equal(ckpt["optimizer_states"], [saved[0]["optim"]])
    assert not [n for n in os.listdir(tmp_path) if n != "full.ckpt"]  # no temporary left
    # Rank 0 held about a unit of gathered state at a time: far below the 144 MiB the whole state takes.
    whole = sum(v.numel() * v.element_size() for v in ckpt["state_dict"].values()) * 3 / 2**20
    assert saved[0]["extra_mib"] < 0.4 * whole, (saved[0]["extra_mib"], whole)
    # The state is the unsharded model's after the same steps on the global batch, and each optimizer state is a
    # tensor of its own (torch FSDP1 on CPU has returned exp_avg and exp_avg_sq sharing one storage).
    reference = _model()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(2):
        reference(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))).pow(
            2
        ).mean().backward()
        opt.step()
        opt.zero_grad()
    for key, value in reference.state_dict().items():  # Adam divides by sqrt(v): rounding of tiny grads shows
        torch.testing.assert_close(ckpt["state_dict"][key], value, rtol=1e-5, atol=5e-5)
    expected = opt.state_dict()["state"]
    for idx, entries in ckpt["optimizer_states"][0]["state"].items():
        avg, sq = entries["exp_avg"], entries["exp_avg_sq"]
        assert avg.untyped_storage().data_ptr() != sq.untyped_storage().data_ptr() and not torch.equal(
            avg, sq
        )
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                entries[name], expected[idx][name], rtol=1e-5, atol=1e-7, msg=f"{idx} {name}"
            )
    for world in (1, 3):
        resumed = spawn(_resume, world, str(tmp_path))[0]
        assert resumed["extra"] == {"step": 2}
        assert _equal(resumed["model"], saved[0]["model"]) and _equal(resumed["optim"], saved[0]["optim"])


def _fail_midway(rank: int, world: int, folder: str, at_start: bool) -> dict[str, Any]:
    """Save once; the second save's writes fail on rank 0 (a full disk): after its first unit, or at once."""
    from flatshard.checkpoint.stream_file import StreamedTorchFile

    torch.set_num_threads(1)
    model, opt = _trained(rank, world)
    path = Path(folder) / "full.ckpt"
    flatshard.save_checkpoint(path, model, opt, extra={"save": 1})
    real, written = StreamedTorchFile.tensor, {"n": 0}

    def tensor(self: StreamedTorchFile, t: torch.Tensor) -> Any:
        written["n"] += 1
        if written["n"] > (0 if at_start else 3):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, t)

    StreamedTorchFile.tensor = tensor  # type: ignore[method-assign]
    try:
        flatshard.save_checkpoint(path, model, opt, extra={"save": 2})
    except CheckpointError as err:
        return {"error": str(err), "listing": sorted(os.listdir(folder))}
    finally:
        StreamedTorchFile.tensor = real  # type: ignore[method-assign]
    return {"error": None, "listing": sorted(os.listdir(folder))}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("at_start", [False, True], ids=["midway", "first_write"])
def test_a_write_failing_fails_the_streamed_save_on_every_rank(tmp_path: Path, at_start: bool) -> None:
    results = spawn(_fail_midway, 2, str(tmp_path), at_start)
    for rank, r in enumerate(results):
        assert r["error"] is not None, rank
        assert "No space left on device" in r["error"] and "full.ckpt" in r["error"], (rank, r["error"])
        assert "HINT" in r["error"], (rank, r["error"])
    assert results[0]["listing"] == ["full.ckpt"]  # the temporary is gone
    assert torch.load(tmp_path / "full.ckpt", weights_only=True)["save"] == 1  # the first save, whole


def _load_growth(rank: int, world: int, folder: str, stepped: bool) -> dict[str, Any]:
    """Peak memory growth (anonymous + file pages) of this rank while it loads the full file."""
    torch.set_num_threads(1)
    model = flatshard.shard(_model(), auto_wrap_policy={nn.Linear})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:  # the optimizer's state exists already (a run that stepped): loaded in place
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    flatshard.load_checkpoint(Path(folder) / "full.ckpt", model, opt)
    growth = _hwm_mib() - before
    state, optim = flatshard.get_state_dict(model, opt)
    return {"growth_mib": growth, "model": state, "optim": optim}


@pytest.mark.slow
@pytest.mark.parametrize("stepped", [False, True])
def test_resuming_from_a_full_file_reads_only_what_each_rank_keeps(tmp_path: Path, stepped: bool) -> None:
    """See [Note: reading a full file by byte ranges]: a rank's memory grows by what it keeps (its half of the
    optimizer state, a third of the file, when the optimizer has none yet; nothing when it has), plus a window
    of one tensor's pages and the file's index, not by the pages of the file it read (half the file)."""
    saved = spawn(_save, 2, str(tmp_path))
    file_mib = (tmp_path / "full.ckpt").stat().st_size / 2**20
    loaded = spawn(_load_growth, 2, str(tmp_path), stepped)
    assert _equal(loaded[0]["model"], saved[0]["model"]) and _equal(loaded[0]["optim"], saved[0]["optim"])
    keeps = 0.0 if stepped else file_mib / 3
    for rank in range(2):
        assert loaded[rank]["growth_mib"] < keeps + 8, (rank, loaded[rank]["growth_mib"], file_mib)
