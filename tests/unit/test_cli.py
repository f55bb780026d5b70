"""The flatshard command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flatshard
from flatshard.checkpoint.files import atomic_save
from flatshard.cli import main
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _ckpt(path: Path) -> Path:
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters())
    model.loss(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)).backward()
    opt.step()
    atomic_save(
        {
            "epoch": 1,
            "global_step": 7,
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
        },
        path,
    )
    return path


def test_inspect_prints_summary(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(_ckpt(tmp_path / "a.ckpt")), "--all"]) == 0
    out = capsys.readouterr().out
    assert "global_step: 7" in out and "blocks.2.out.weight" in out and "exp_avg_sq" in out


def test_inspect_truncated_file_fails_with_message(tmp_path: Path, capsys) -> None:
    path = _ckpt(tmp_path / "a.ckpt")
    path.write_bytes(path.read_bytes()[:100])
    assert main(["inspect", str(path)]) == 2
    assert "a.ckpt" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "flatshard.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout


# ------------------------------------------------------------------------------------- sharded directories
def _write_sharded(rank: int, world: int, path: str) -> dict:
    """2 ranks train TinyGPT 2 steps, save a sharded directory, return the gathered full state (rank 0)."""
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        idx, tgt = make_batch(step, 4)
        model.loss(idx[rank * 2 : (rank + 1) * 2], tgt[rank * 2 : (rank + 1) * 2]).backward()
        opt.step()
        opt.zero_grad()
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded", extra={"global_step": 2})
    model_state, optim_state = flatshard.get_state_dict(model, opt, full=True)
    return {"model": model_state, "optim": optim_state}


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    results = spawn(_write_sharded, 2, str(path))
    return path, results[0]


def _assert_equal(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert sorted(actual, key=str) == sorted(expected, key=str), (where, sorted(actual), sorted(expected))
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


@pytest.mark.timeout(300)
def test_consolidate_sharded_dir_equals_full_state_of_the_run(
    sharded_dir: tuple[Path, dict], tmp_path: Path, capsys
) -> None:
    path, full = sharded_dir
    out = tmp_path / "full.ckpt"
    assert main(["consolidate", str(path), str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    ckpt = torch.load(out, map_location="cpu", weights_only=False)
    assert sorted(ckpt) == ["global_step", "optimizer_states", "state_dict"]
    assert ckpt["global_step"] == 2
    assert list(ckpt["state_dict"]) == list(TinyGPT().state_dict())  # the model's own key order
    _assert_equal(ckpt["state_dict"], full["model"], "state_dict")
    assert len(ckpt["optimizer_states"]) == 1
    _assert_equal(ckpt["optimizer_states"][0], full["optim"], "optimizer_states[0]")
    # The plain model and optimizer take it as is.
    model = TinyGPT()
    model.load_state_dict(ckpt["state_dict"])
    torch.optim.AdamW(model.parameters(), lr=1e-2).load_state_dict(ckpt["optimizer_states"][0])
    assert sorted(os.listdir(tmp_path)) == ["full.ckpt"]  # written atomically, nothing else left


@pytest.mark.timeout(300)
def test_inspect_sharded_dir_prints_keys(sharded_dir: tuple[Path, dict], capsys) -> None:
    path, full = sharded_dir
    assert main(["inspect", str(path), "--all"]) == 0
    out = capsys.readouterr().out
    assert "sharded checkpoint" in out and "written by 2 ranks" in out and "global_step: 2" in out
    for key, value in full["model"].items():
        assert any(line.split()[:1] == [key] for line in out.splitlines()), f"{key} not listed"
        line = next(line for line in out.splitlines() if line.split()[:1] == [key])
        assert str(tuple(value.shape)) in line, line
    assert "tied to wte.weight" in out  # head.weight
    assert "exp_avg_sq" in out
    # without --all: the first 20 keys and how many more there are
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    keys = list(full["model"])
    assert f"... {len(keys) - 20} more (use --all)" in out
    assert keys[19] in out and not any(line.split()[:1] == [keys[20]] for line in out.splitlines())


@pytest.mark.timeout(300)
def test_consolidate_damaged_sharded_dir_fails_naming_the_file(
    sharded_dir: tuple[Path, dict], tmp_path: Path, capsys
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(sharded_dir[0], damaged)
    victim = sorted(damaged.glob("*.distcp"))[-1]
    victim.unlink()
    out = tmp_path / "out.ckpt"
    assert main(["consolidate", str(damaged), str(out)]) == 2
    captured = capsys.readouterr()
    assert victim.name in captured.err and str(damaged) in captured.err, captured.err
    assert "missing" in captured.err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["damaged"]
    # inspect reports the same damage
    assert main(["inspect", str(damaged)]) == 2
    assert victim.name in capsys.readouterr().err
