"""Every dtype through the offline writers: ``export_safetensors`` and ``flatshard consolidate`` to
``.safetensors`` write each dtype of the safetensors specification (float8 and float4 included, the header in the
specification's codes and logical shapes) byte for byte, from a full file or a sharded directory; ``consolidate``
to ``.ckpt`` keeps every dtype a sharded directory holds. A dtype a format cannot store is refused with a
``CheckpointError`` and a hint before any file is created: safetensors (complex32, complex128, quantized, bits),
a sharded save (bits, quantized: DCP plans or reads them wrong) and its ``meta.pt`` (what ``torch.save`` cannot
store). No processes: the sharded directories are written by this process alone."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from flatshard.checkpoint import CheckpointError, consolidate, export_safetensors, write_sharded_checkpoint
from flatshard.checkpoint.files import atomic_save
from flatshard.checkpoint.safetensors_format import CODES
from flatshard.checkpoint.write_sharded import dcp_unreadable_dtype
from flatshard.engine import ParamShard
from tests.dtype_cases import SAVED, bits, dtype_name, same, sample

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors deprecated, ComplexHalf

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

STORED = [d for d in SAVED if d in CODES]  # what safetensors stores
NOT_STORED = [d for d in SAVED if d not in CODES]
DCP_REFUSED = [d for d in SAVED if dtype_name(d).startswith(("bits", "q"))]
IN_DIRECTORY = [d for d in SAVED if d not in DCP_REFUSED]
PACKAGE_READS = [
    d for d in STORED if dtype_name(d) not in ("float8_e8m0fnu", "float4_e2m1fn_x2")
]  # safetensors 0.8


def _state(dtypes: list[torch.dtype]) -> dict[str, torch.Tensor]:
    return {f"model.{dtype_name(d)}": sample(d, (3, 4), seed=i) for i, d in enumerate(dtypes)}


def _read(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor's dtype code, header shape and bytes, read from the file as the specification lays it out."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0] : base + v["data_offsets"][1]])
        for k, v in header.items()
    }


def _check_export(path: Path, state: dict[str, torch.Tensor]) -> None:
    stored = _read(path)
    assert sorted(stored) == sorted(state)
    for key, want in state.items():
        code, shape, data = stored[key]
        assert code == CODES[want.dtype], key
        logical = [*want.shape[:-1], want.shape[-1] * 2] if code == "F4" else list(want.shape)  # two per byte
        assert shape == logical and data == bits(want), key
    readable = {k: v for k, v in state.items() if v.dtype in PACKAGE_READS}
    if len(readable) == len(state):
        for key, value in load_file(path).items():  # the safetensors package agrees
            same(value, state[key], key)


def _directory(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """A sharded directory holding ``state``: matrices as pieces (as a sharded module saves them), the rest
    whole."""
    pieces = {
        k: ParamShard(v.reshape(-1).clone(), 0, v.shape) if i % 2 == 0 else v
        for i, (k, v) in enumerate(state.items())
    }
    path = tmp_path / "sharded"
    write_sharded_checkpoint({"state_dict": pieces, "epoch": 1}, path)
    return path


def test_export_from_a_full_file_writes_every_safetensors_dtype(tmp_path: Path) -> None:
    state = _state(STORED)
    src = tmp_path / "full.ckpt"
    atomic_save({"state_dict": state}, src)
    result = export_safetensors(src, tmp_path / "w.safetensors")
    assert result.tensors == len(STORED)
    _check_export(tmp_path / "w.safetensors", state)
    readable = _state(PACKAGE_READS)
    atomic_save({"state_dict": readable}, tmp_path / "readable.ckpt")
    export_safetensors(tmp_path / "readable.ckpt", tmp_path / "readable.safetensors")
    _check_export(tmp_path / "readable.safetensors", readable)  # read by the safetensors package too


def test_a_sharded_directory_exports_and_consolidates_every_dtype_it_holds(tmp_path: Path) -> None:
    src = _directory(tmp_path, _state(IN_DIRECTORY))
    consolidate(src, tmp_path / "full.ckpt")
    back = torch.load(tmp_path / "full.ckpt", weights_only=True)
    for key, want in _state(IN_DIRECTORY).items():
        same(back["state_dict"][key], want, key)
    weights = _directory(tmp_path / "w", _state(STORED))
    export_safetensors(weights, tmp_path / "export.safetensors")
    _check_export(tmp_path / "export.safetensors", _state(STORED))
    consolidate(weights, tmp_path / "consolidated.safetensors")
    assert _read(tmp_path / "consolidated.safetensors") == _read(tmp_path / "export.safetensors")


@pytest.mark.parametrize("dtype", NOT_STORED, ids=dtype_name)
def test_a_dtype_safetensors_cannot_store_is_refused_before_any_file(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    name = f"model.{dtype_name(dtype)}"
    src = tmp_path / "full.ckpt"
    atomic_save({"state_dict": {"model.ok": torch.ones(2), name: sample(dtype, (2, 2))}}, src)
    sources = [src] if dtype in DCP_REFUSED else [src, _directory(tmp_path, {name: sample(dtype, (2, 2))})]
    for source in sources:
        for write in (export_safetensors, consolidate):
            with pytest.raises(CheckpointError) as caught:
                write(source, tmp_path / "out.safetensors")
            message = str(caught.value)
            assert f"{name!r} has dtype {dtype}, which safetensors cannot store" in message, message
            assert "HINT: export to .ckpt" in message, message
            assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in sources), os.listdir(tmp_path)


@pytest.mark.parametrize("dtype", DCP_REFUSED, ids=dtype_name)
def test_a_sharded_save_refuses_what_dcp_cannot_give_back(dtype: torch.dtype, tmp_path: Path) -> None:
    assert dcp_unreadable_dtype(dtype) is not None
    state = {"ok": torch.ones(3), "w": sample(dtype, (2, 4))}
    with pytest.raises(CheckpointError) as caught:
        write_sharded_checkpoint({"state_dict": state}, tmp_path / "sharded")
    message = str(caught.value)
    assert f"Cannot write model.w (a {dtype} tensor) into a sharded checkpoint" in message, message
    assert "HINT: save a full checkpoint (state_dict_type='full')" in message, message
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left


def test_a_sharded_save_refuses_what_its_meta_file_cannot_hold(tmp_path: Path) -> None:
    checkpoint = {"state_dict": {"ok": torch.ones(3)}, "loops": {"packed": sample(torch.uint4, (4,))}}
    with pytest.raises(
        CheckpointError, match=r"loops\['packed'\] \(a torch.uint4 tensor\) into .*meta.pt.*HINT"
    ):
        write_sharded_checkpoint(checkpoint, tmp_path / "sharded")
    assert os.listdir(tmp_path) == []


def test_every_dtype_of_a_directory_passes_the_dcp_probe() -> None:
    assert {dtype_name(d): dcp_unreadable_dtype(d) for d in IN_DIRECTORY} == {
        dtype_name(d): None for d in IN_DIRECTORY
    }
