"""Checkpoint files: atomic writes and readable errors."""

from __future__ import annotations

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
