"""Every dtype ``torch.save`` stores goes through the streamed ``torch.save`` writer (see [Note: every dtype
torch.save writes]): streamed as it comes, left in the object, or a view, the file holds the records and the very
``data.pkl`` that ``torch.save`` writes, and ``torch.load`` reads it back bit for bit (``weights_only`` either
way, ``mmap`` too). A dtype ``torch.save`` cannot store is refused by ``finish``, naming the tensor and its dtype
with a hint, before ``data.pkl`` is written."""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from flatshard.checkpoint import CheckpointError
from flatshard.checkpoint.stream_file import StreamedTorchFile, unreadable_dtype
from tests.dtype_cases import CASES, REFUSED, DtypeCase, dtype_name, same, sample

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors deprecated, ComplexHalf


def _records(data: bytes) -> dict[str, bytes]:
    """The archive's records by name under its folder, but the id torch draws at random for each file."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_dtype_is_written_as_torch_save_writes_it(case: DtypeCase, tmp_path: Path) -> None:
    streamed, whole = case.tensor(seed=1), case.tensor((2, 5), seed=2)
    obj = {"state_dict": {"streamed": streamed, "whole": whole}, "epoch": 3}
    saved = io.BytesIO()
    torch.save(obj, saved)
    writer = StreamedTorchFile(str(tmp_path / "streamed.pt"))
    writer.finish({"state_dict": {"streamed": writer.tensor(streamed), "whole": whole}, "epoch": 3})
    data = (tmp_path / "streamed.pt").read_bytes()
    assert _records(data) == _records(saved.getvalue())  # data.pkl included: the same file
    for weights_only in (True, False):
        for mmap in (False, True):
            back = torch.load(tmp_path / "streamed.pt", weights_only=weights_only, mmap=mmap)
            same(back["state_dict"]["streamed"], streamed, f"{case.name} streamed")
            same(back["state_dict"]["whole"], whole, f"{case.name} left in the object")
            assert back["epoch"] == 3


@pytest.mark.parametrize("case", [c for c in CASES if not c.tensor().is_quantized], ids=lambda c: c.name)
def test_views_and_shared_storages_of_every_dtype(case: DtypeCase) -> None:
    base = case.tensor((6, 4), seed=3)
    view, strided, row = base[1:3], base[:, 1], base[4]
    buffer = io.BytesIO()
    writer = StreamedTorchFile(buffer)
    writer.finish({"view": writer.tensor(view), "strided": writer.tensor(strided), "row": row, "base": base})
    back = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    for name, want in (("view", view), ("strided", strided), ("row", row), ("base", base)):
        same(back[name], want, f"{case.name} {name}")
    # Left in the object, a view and its base share one storage, as torch.save keeps them.
    assert back["row"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", REFUSED, ids=dtype_name)
def test_a_dtype_torch_save_cannot_store_is_refused_before_the_file_is_finished(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    assert unreadable_dtype(dtype) is not None
    t = sample(dtype, (4,))
    for how in ("streamed", "left in the object"):
        path = tmp_path / f"{how}.pt"
        writer = StreamedTorchFile(str(path))
        value = writer.tensor(t) if how == "streamed" else t
        with pytest.raises(CheckpointError) as caught:
            writer.finish({"state_dict": {"ok": writer.tensor(torch.ones(2)), "packed.w": value}})
        writer.close()
        message = str(caught.value)
        assert f"state_dict['packed.w'] (a {dtype} tensor)" in message, message
        assert "HINT: torch.save cannot store this dtype either" in message, message
        with pytest.raises(RuntimeError):  # no data.pkl: not a checkpoint
            torch.load(path, weights_only=True)


def test_the_refusal_names_every_tensor_it_cannot_store() -> None:
    writer = StreamedTorchFile(io.BytesIO())
    obj = {
        "a": [sample(torch.uint4, (2,)), {"b": writer.tensor(sample(torch.int3, (2,)))}],
        "c": torch.ones(1),
    }
    with pytest.raises(
        CheckpointError, match=r"Cannot write a\[0\] .*The same holds for 1 more: a\[1\]\['b'\]"
    ):
        writer.finish(obj)


class _Holder:
    """An object the refusal does not look into: its tensor is refused when pickled."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_a_tensor_inside_another_object_is_refused_too() -> None:
    writer = StreamedTorchFile(io.BytesIO())
    with pytest.raises(CheckpointError, match=r"a torch.uint2 tensor"):
        writer.finish({"holder": _Holder(sample(torch.uint2, (3,)))})


def test_every_dtype_torch_save_stores_passes_the_probe() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe keeps torch's warnings to itself
        assert {c.name: unreadable_dtype(c.dtype) for c in CASES} == {c.name: None for c in CASES}
