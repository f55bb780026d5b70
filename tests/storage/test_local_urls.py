"""URLs that need no server: ``file://`` (the local path, with the local atomic writes) and ``memory://``
(fsspec's in-memory filesystem, one process), through ``flatshard.save_checkpoint`` / ``load_checkpoint`` /
``consolidate`` / ``remove_checkpoint``; and how a path is told to be local or a URL."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import flatshard
from flatshard.checkpoint import CheckpointError, is_sharded_checkpoint, is_url, locate, remove_checkpoint

from .conftest import trained_tinygpt


def _assert_loads_back(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fresh, fresh_optimizer = trained_tinygpt(seed=123, steps=0)
    assert flatshard.load_checkpoint(url, fresh, fresh_optimizer) == {"step": 1}
    expected = flatshard.get_state_dict(model, optimizer, rank0_only=False)
    actual = flatshard.get_state_dict(fresh, fresh_optimizer, rank0_only=False)
    for key, value in expected[0].items():
        assert torch.equal(actual[0][key], value), key
    for idx, entries in expected[1]["state"].items():
        assert torch.equal(actual[1]["state"][idx]["exp_avg"], entries["exp_avg"]), idx


def test_paths_and_urls_are_told_apart_by_their_text() -> None:
    assert is_url("s3://bucket/run") and is_url("gs://b/x") and is_url("memory://x")
    assert not is_url("/tmp/run") and not is_url("run/last.ckpt") and not is_url("file:///tmp/run")
    assert not is_url(Path("s3://bucket/run"))  # a Path is never a URL: it is refused when used
    assert locate("file:///tmp/run/last.ckpt") == Path("/tmp/run/last.ckpt")
    assert locate("run/last.ckpt") == Path("run/last.ckpt")
    remote = locate("memory://bucket/run/")
    assert not isinstance(remote, Path) and str(remote) == "memory://bucket/run"
    with pytest.raises(CheckpointError, match="whose '//' was collapsed"):
        locate(Path("s3://bucket/run"))
    with pytest.raises(CheckpointError, match="Protocol not known"):
        locate("no-such-protocol://bucket/run")


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_file_urls_are_local_paths(kind: str, tmp_path: Path) -> None:
    model, optimizer = trained_tinygpt()
    url = f"file://{tmp_path}/ckpt"
    assert flatshard.save_checkpoint(url, model, optimizer, state_dict_type=kind, extra={"step": 1}) == (
        tmp_path / "ckpt"
    )
    assert (tmp_path / "ckpt").is_dir() == (kind == "sharded")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left, nothing under a "file:" directory
    _assert_loads_back(url, model, optimizer)
    remove_checkpoint(url)
    assert os.listdir(tmp_path) == []


def test_memory_urls_save_load_consolidate_and_remove() -> None:
    root = f"memory://flatshard-test-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    model, optimizer = trained_tinygpt()
    for kind in ("full", "sharded"):
        url = f"{root}/{kind}.ckpt"
        for _ in range(2):  # the second save replaces the first
            assert (
                flatshard.save_checkpoint(url, model, optimizer, state_dict_type=kind, extra={"step": 1})
                == url
            )
        assert is_sharded_checkpoint(url) == (kind == "sharded")
        _assert_loads_back(url, model, optimizer)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/sharded.ckpt", detail=False))
    data = [n for n in names if n.endswith(".distcp")]
    assert names == sorted([".metadata", "meta.pt", *data]) and len(data) == 1, names  # the new save's only
    assert flatshard.consolidate(f"{root}/sharded.ckpt", f"{root}/out.ckpt") == f"{root}/out.ckpt"
    with fsspec.open(f"{root}/out.ckpt", "rb") as f:
        consolidated: dict[str, Any] = torch.load(f, weights_only=False)
    expected, _ = flatshard.get_state_dict(model, optimizer)
    for key, value in expected.items():
        assert torch.equal(consolidated["state_dict"][key], value), key
    with pytest.raises(IsADirectoryError, match="a directory"):
        flatshard.save_checkpoint(f"{root}/sharded.ckpt", model, optimizer)  # a full file over a directory
    for name in ("full.ckpt", "sharded.ckpt", "out.ckpt"):
        remove_checkpoint(f"{root}/{name}")
        assert not fs.exists(f"{root}/{name}")
    remove_checkpoint(f"{root}/absent.ckpt")  # nothing to remove: no error
