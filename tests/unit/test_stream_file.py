"""A ``torch.save`` archive written tensor by tensor (see [Note: a torch.save file written as it streams]): torch's
own loader reads it, with ``weights_only=True`` and ``mmap=True``, to the same object ``torch.save`` would give."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from flatshard.checkpoint.stream_file import StreamedTorchFile


def _checkpoint() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "state_dict": {
            "w": torch.randn(5, 3, generator=g),
            "b16": torch.randn(7, generator=g).to(torch.bfloat16),
            "half": torch.randn(2, 2, generator=g).half(),
            "count": torch.tensor(3, dtype=torch.int64),
            "empty": torch.empty(0, 4),
            "mask": torch.tensor([True, False]),
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(5, 3, generator=g)}},
                "param_groups": [],
            }
        ],
        "epoch": 4,
        "hparams": {"lr": 1e-3, "name": "x"},
    }


def _stream(
    obj: dict, f: str | io.BytesIO, streamed: tuple[str, ...] = ("w", "b16", "half", "empty")
) -> None:
    """Write the named model tensors as they come, and the rest (small tensors, other values) at the end."""
    writer = StreamedTorchFile(f)
    out = dict(obj)
    out["state_dict"] = {k: writer.tensor(v) if k in streamed else v for k, v in obj["state_dict"].items()}
    state = obj["optimizer_states"][0]["state"][0]
    out["optimizer_states"] = [
        {**obj["optimizer_states"][0], "state": {0: {**state, "exp_avg": writer.tensor(state["exp_avg"])}}}
    ]
    writer.finish(out)


def _assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_reads_a_streamed_file_as_torch_save_wrote_it(tmp_path: Path, mmap: bool) -> None:
    obj = _checkpoint()
    torch.save(obj, tmp_path / "saved.pt")
    _stream(obj, str(tmp_path / "streamed.pt"))
    saved = torch.load(tmp_path / "saved.pt", weights_only=True, mmap=mmap)
    streamed = torch.load(tmp_path / "streamed.pt", weights_only=True, mmap=mmap)
    _assert_same(saved, streamed)
    _assert_same(obj, streamed)
    records = {
        Path(n).name if "/data/" not in n else "data/*"
        for n in zipfile.ZipFile(tmp_path / "saved.pt").namelist()
    }
    mine = {
        Path(n).name if "/data/" not in n else "data/*"
        for n in zipfile.ZipFile(tmp_path / "streamed.pt").namelist()
    }
    assert mine == records  # the same kinds of records: data.pkl, storages, version, alignment, byte order


def test_a_streamed_file_loads_where_flatshard_is_not_installed(tmp_path: Path) -> None:
    buffer = io.BytesIO()  # and the writer takes any object with write()
    _stream(_checkpoint(), buffer)
    (tmp_path / "c.pt").write_bytes(buffer.getvalue())
    code = (
        "import sys, torch; sys.modules['flatshard'] = None; "
        f"c = torch.load({str(tmp_path / 'c.pt')!r}, weights_only=True); "
        "print(c['state_dict']['b16'].dtype, c['epoch'], c['optimizer_states'][0]['state'][0]['exp_avg'].shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["torch.bfloat16", "4", "torch.Size([5,", "3])"]


def test_views_and_shared_storages_are_written_as_their_own_elements(tmp_path: Path) -> None:
    base = torch.arange(20.0)
    writer = StreamedTorchFile(str(tmp_path / "v.pt"))
    view, strided = base[5:9], base.view(4, 5)[:, 1]
    writer.finish({"view": writer.tensor(view), "strided": writer.tensor(strided), "whole": base})
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)
    assert torch.equal(loaded["view"], view) and torch.equal(loaded["strided"], strided)
    assert torch.equal(loaded["whole"], base)


def test_a_file_closed_without_finish_is_refused_by_torch_load(tmp_path: Path) -> None:
    writer = StreamedTorchFile(str(tmp_path / "cut.pt"))
    writer.tensor(torch.ones(3))
    writer.close()  # an interrupted save: no data.pkl
    with pytest.raises(RuntimeError):
        torch.load(tmp_path / "cut.pt", weights_only=True)
