"""Checkpoint files: atomic writes and readable errors."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatshard.checkpoint.files import CheckpointError, atomic_save, load_checkpoint_file


class _ExplodesWhenPickled:
    def __reduce__(self) -> tuple:
        raise RuntimeError("boom while writing")


def test_atomic_save_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.ckpt"
    atomic_save({"state_dict": {"w": torch.ones(3)}}, path)
    atomic_save({"state_dict": {"w": torch.zeros(3)}}, path)
    assert torch.equal(load_checkpoint_file(path)["state_dict"]["w"], torch.zeros(3))
    assert [p.name for p in path.parent.iterdir()] == ["a.ckpt"]


def test_atomic_save_mode_follows_umask_and_existing_file(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = tmp_path / "a.ckpt"
        atomic_save({"w": torch.ones(1)}, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640  # what open() would give, not mkstemp's 0600
        path.chmod(0o604)
        atomic_save({"w": torch.zeros(1)}, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o604  # a replaced file keeps its permissions
    finally:
        os.umask(old)


def test_atomic_save_removes_temporaries_of_dead_processes(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".a.ckpt.{host}-{dead.pid}.x1y2.tmp"
    live = tmp_path / f".a.ckpt.{host}-{os.getpid()}.x1y2.tmp"  # a save in progress: left alone
    other = tmp_path / f".b.ckpt.{host}-{dead.pid}.x1y2.tmp"  # another checkpoint's, a dead run's: removed
    other_live = tmp_path / f".b.ckpt.{host}-{os.getpid()}.x1y2.tmp"  # another checkpoint's, in progress
    for f in (stale, live, other, other_live):
        f.write_bytes(b"partial")
    atomic_save({"w": torch.ones(1)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.ckpt", live.name, other_live.name])


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    atomic_save({"state_dict": {"w": torch.ones(3)}}, path)
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"state_dict": {"w": torch.zeros(3)}, "bad": _ExplodesWhenPickled()}, path)
    assert torch.equal(load_checkpoint_file(path)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]


def test_truncated_checkpoint_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    atomic_save({"state_dict": {"w": torch.randn(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="a.ckpt.*truncated"):
        load_checkpoint_file(path)


def test_empty_missing_and_wrong_kind(tmp_path: Path) -> None:
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint_file(tmp_path / "empty.ckpt")
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load_checkpoint_file(tmp_path / "nope.ckpt")
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(CheckpointError, match="list"):
        load_checkpoint_file(tmp_path / "list.ckpt")
    unfinished = tmp_path / "unfinished.ckpt"  # a sharded save that stopped before its .metadata
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"without a \.metadata file.*__0_0\.distcp"):
        load_checkpoint_file(unfinished)
    (unfinished / ".metadata").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="consolidate"):
        load_checkpoint_file(unfinished)
