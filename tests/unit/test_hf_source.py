"""Hugging Face checkpoints read by byte range (``flatshard.checkpoint.hf_source``): every tensor's element
ranges equal the loaded tensor bit for bit, for ``.safetensors`` (one file and an index, written by
``safetensors`` and by ``transformers``) and ``.bin`` (one file and an index), locally and at a ``memory://``
URL; ``.safetensors`` reads fetch exactly the requested bytes, in merged, bounded reads; and each damaged or
inconsistent checkpoint fails at open (a failing read at read time) with a ``CheckpointError`` naming the file
and the tensor."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import safetensors.torch
import torch

from flatshard.checkpoint import CheckpointError
from flatshard.checkpoint import byte_ranges as byte_ranges_module
from flatshard.checkpoint.hf_source import PretrainedSource, SourceTensor, open_source

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------------------------------ checkpoints
def dtype_tensors() -> dict[str, torch.Tensor]:
    """One tensor per dtype the tests cover, of several shapes (a scalar and an empty one among them)."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 4, 6, generator=g).to(torch.bfloat16),
        "f16": torch.randn(33, generator=g).half(),
        "f8": (torch.randn(4, 9, generator=g) * 4).to(torch.float8_e4m3fn),
        "i64": torch.randint(-(2**40), 2**40, (11,), generator=g),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        "u16": torch.randint(0, 2**16, (6, 2), generator=g).to(torch.uint16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype)


def save_llama(out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Llama saved by ``save_pretrained`` in several ``.safetensors`` files with an index."""
    tiny_llama(dtype).save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    return out


def save_bin_index(out: Path, state: dict[str, torch.Tensor], files: int) -> Path:
    """``state`` as Hugging Face's ``.bin`` layout: ``pytorch_model-0000k-of-0000n.bin`` files and their index."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for k in range(files):
        file_name = f"pytorch_model-{k + 1:05d}-of-{files:05d}.bin"
        part = {n: state[n] for n in names[k::files]}
        torch.save(part, out / file_name)
        weight_map.update(dict.fromkeys(part, file_name))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def expected_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint files in ``folder``, loaded whole by their own libraries."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            out.update(safetensors.torch.load_file(path))
        elif path.suffix == ".bin":
            out.update(torch.load(path, weights_only=True))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_source")
    single = root / "single"
    single.mkdir()
    safetensors.torch.save_file(dtype_tensors(), single / "model.safetensors")
    bin_single = root / "bin_single"
    bin_single.mkdir()
    state = dtype_tensors()
    state["transposed"] = state["f32"].t()  # non-contiguous, sharing the storage of "f32"
    state["row"] = state["f32"][2]  # a view at an offset in that storage
    torch.save(state, bin_single / "pytorch_model.bin")
    llama = save_llama(root / "llama", torch.bfloat16)
    bin_index = save_bin_index(root / "bin_index", tiny_llama().state_dict(), files=3)
    return {"single": single, "bin_single": bin_single, "llama": llama, "bin_index": bin_index}


# --------------------------------------------------------------------------------------------- checking
def random_requests(
    source: PretrainedSource, rng: random.Random, per_tensor: int = 4
) -> list[tuple[SourceTensor, int, torch.Tensor]]:
    """Random element ranges of every tensor (the whole tensor, a first and a last element, an empty range
    and random ones among them), in random order."""
    requests = []
    for tensor in source.tensors.values():
        n = tensor.numel
        ranges = [(0, n), (n, n)] if n == 0 else [(0, n), (0, 1), (n - 1, n), (rng.randrange(n), None)]
        for _ in range(per_tensor):
            if n:
                a = rng.randrange(n)
                ranges.append((a, rng.randint(a, n)))
        for a, b in ranges:
            b = a if b is None else b
            requests.append((tensor, a, torch.empty(b - a, dtype=tensor.dtype)))
    rng.shuffle(requests)
    return requests


def assert_reads_match(
    source: PretrainedSource, expected: dict[str, torch.Tensor], seed: int = 0, exact_bytes: bool = True
) -> None:
    """Random ranges of every tensor, read in one call, equal ``expected`` bit for bit; with ``exact_bytes``
    the source fetched exactly the requested bytes."""
    assert sorted(source.tensors) == sorted(expected)
    for name, tensor in source.tensors.items():
        assert (tensor.dtype, tensor.shape) == (expected[name].dtype, tuple(expected[name].shape)), name
    requests = random_requests(source, random.Random(seed))
    before = source.bytes_read
    source.read(requests)
    for tensor, first, out in requests:
        want = expected[tensor.name].reshape(-1)[first : first + out.numel()]
        assert torch.equal(out.view(torch.uint8), want.contiguous().view(torch.uint8)), (tensor.name, first)
    if exact_bytes:
        asked = sum(out.numel() * out.element_size() for _, _, out in requests)
        assert source.bytes_read - before == asked


# -------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize("kind", ["single", "llama"])
def test_safetensors_ranges_equal_the_tensors_and_read_exactly_their_bytes(
    ckpts: dict[str, Path], kind: str
) -> None:
    with open_source(ckpts[kind]) as source:
        assert source.notes == []
        assert_reads_match(source, expected_state(ckpts[kind]))
        files = sorted({t.file for t in source.tensors.values()})
    if kind == "llama":  # save_pretrained's index and its files, all read
        index = json.loads((ckpts[kind] / "model.safetensors.index.json").read_text())
        assert files == sorted(str(ckpts[kind] / f) for f in set(index["weight_map"].values()))
        assert len(files) > 2
        assert {t.dtype for t in source.tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["bin_single", "bin_index"])
def test_bin_ranges_equal_the_tensors(ckpts: dict[str, Path], kind: str) -> None:
    with open_source(ckpts[kind]) as source:
        assert any(".bin format" in note and "memory-mapped" in note for note in source.notes), source.notes
        assert_reads_match(source, expected_state(ckpts[kind]), seed=1)
        assert_reads_match(source, expected_state(ckpts[kind]), seed=2)  # a file mapped again


def test_a_file_an_index_and_a_file_url_open_alike(ckpts: dict[str, Path]) -> None:
    expected = expected_state(ckpts["llama"])
    for source in (ckpts["llama"] / "model.safetensors.index.json", f"file://{ckpts['llama']}"):
        with open_source(source) as opened:
            assert_reads_match(opened, expected)
    with open_source(ckpts["single"] / "model.safetensors") as opened:
        assert_reads_match(opened, expected_state(ckpts["single"]))
    with open_source(ckpts["bin_single"] / "pytorch_model.bin") as opened:
        assert_reads_match(opened, expected_state(ckpts["bin_single"]))


def _header(path: str | Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    return header


def test_tensors_are_in_file_order(ckpts: dict[str, Path]) -> None:
    with open_source(ckpts["llama"]) as source:
        files = [t.file for t in source.tensors.values()]
        assert files == sorted(files)  # file by file, in name order
        for file in set(files):
            header = _header(file)
            by_offset = sorted(header, key=lambda n: header[n]["data_offsets"])
            assert [t.name for t in source.tensors.values() if t.file == file] == by_offset


def test_safetensors_preferred_over_bin(ckpts: dict[str, Path], tmp_path: Path) -> None:
    both = tmp_path / "both"
    shutil.copytree(ckpts["single"], both)
    shutil.copy(ckpts["bin_single"] / "pytorch_model.bin", both)
    with open_source(both) as source:
        assert {t.file for t in source.tensors.values()} == {str(both / "model.safetensors")}
        assert any("reading model.safetensors" in note for note in source.notes), source.notes


def test_adjacent_requests_are_one_read_and_large_ones_are_chunked(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    expected = expected_state(ckpts["single"])
    with open_source(ckpts["single"]) as source:
        whole = [(t, 0, torch.empty(t.numel, dtype=t.dtype)) for t in source.tensors.values()]
        source.read(whole)  # the tensors lie back to back: one read
        assert len(calls) == 1 and calls[0] == source.bytes_read
        halves = []
        for t in source.tensors.values():  # each tensor in two requests, also back to back
            halves += [(t, 0, torch.empty(t.numel // 2, dtype=t.dtype))]
            halves += [(t, t.numel // 2, torch.empty(t.numel - t.numel // 2, dtype=t.dtype))]
        calls.clear()
        source.read(halves[::-1])
        assert len(calls) == 1
        for t, first, out in halves:
            want = expected[t.name].reshape(-1)[first : first + out.numel()]
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        monkeypatch.setattr(byte_ranges_module, "CHUNK", 16)
        calls.clear()
        f32 = source.tensors["f32"]
        out = torch.empty(f32.numel, dtype=f32.dtype)
        source.read([(f32, 0, out)])
        assert calls == [16] * (f32.numel * 4 // 16) + ([f32.numel * 4 % 16] if f32.numel * 4 % 16 else [])
        assert torch.equal(out, expected["f32"].reshape(-1))


def test_only_one_bin_file_is_mapped_at_a_time(ckpts: dict[str, Path]) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    folder = ckpts["bin_index"]
    with open_source(folder) as source:
        for tensor in source.tensors.values():  # one call per tensor: files alternate
            source.read([(tensor, 0, torch.empty(tensor.numel, dtype=tensor.dtype))])
            mapped = {p.name for p in folder.glob("*.bin") if str(p.resolve()) in maps.read_text()}
            assert mapped == {Path(tensor.file).name}
    assert not any(str(p.resolve()) in maps.read_text() for p in folder.glob("*.bin"))


def test_requests_that_do_not_fit_are_refused_before_reading(ckpts: dict[str, Path]) -> None:
    with open_source(ckpts["single"]) as source:
        f32 = source.tensors["f32"]
        good = (f32, 0, torch.empty(2, dtype=torch.float32))
        for bad, match in [
            ((f32, 0, torch.empty(2, dtype=torch.float64)), "contiguous 1-D torch.float32"),
            ((f32, 0, torch.empty(2, 2)), "contiguous 1-D"),
            ((f32, 0, torch.empty(4)[::2]), "non-contiguous"),
            ((f32, 34, torch.empty(2)), "not inside 'f32'"),
            ((f32, -1, torch.empty(1)), "not inside"),
            ((SourceTensor("f32", f32.file, torch.float32, (99,)), 0, torch.empty(1)), "not a tensor of"),
        ]:
            with pytest.raises(ValueError, match=match):
                source.read([good, bad])
        assert source.bytes_read == 0
    with pytest.raises(ValueError, match="is closed"):
        source.read([good])


# --------------------------------------------------------------------------------------- URLs (memory)
@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://flatshard-hf-source-{uuid.uuid4().hex[:8]}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def upload(folder: Path, url: str) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    for p in folder.iterdir():
        fs.pipe_file(f"{path}/{p.name}", p.read_bytes())
    return url


def test_memory_url_safetensors_index(ckpts: dict[str, Path], memory_url: str) -> None:
    url = upload(ckpts["llama"], f"{memory_url}/llama")
    with open_source(url) as source:
        assert source.location == url and source.notes == []
        assert all(t.file.startswith(f"{url}/model-") for t in source.tensors.values())
        assert_reads_match(source, expected_state(ckpts["llama"]))
    with open_source(f"{url}/model.safetensors.index.json") as source:
        assert_reads_match(source, expected_state(ckpts["llama"]), seed=3)


def test_memory_url_ranges_are_staged_in_bounded_batches(
    ckpts: dict[str, Path], memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = upload(ckpts["single"], f"{memory_url}/single")
    fs, _ = fsspec.core.url_to_fs(url)
    batches: list[list[int]] = []
    real = fs.cat_ranges

    def recording(paths, starts, ends, **kwargs):  # type: ignore[no-untyped-def]
        batches.append([e - s for s, e in zip(starts, ends)])
        return real(paths, starts, ends, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", recording)
    monkeypatch.setattr(byte_ranges_module, "CHUNK", 64)
    with open_source(url) as source:
        batches.clear()  # the header reads
        assert_reads_match(source, expected_state(ckpts["single"]), seed=4)
    assert batches and all(sum(b) <= 64 for b in batches), batches


def test_memory_url_bin_is_downloaded_once_to_a_temporary_file(
    ckpts: dict[str, Path], memory_url: str
) -> None:
    url = upload(ckpts["bin_index"], f"{memory_url}/bin")
    sizes = sum(p.stat().st_size for p in ckpts["bin_index"].glob("*.bin"))
    with open_source(url) as source:
        assert any("downloaded whole to a temporary file" in note for note in source.notes), source.notes
        assert source.bytes_read == 0  # opening reads the zip directories and pickles only
        assert_reads_match(source, expected_state(ckpts["bin_index"]), exact_bytes=False)
        assert source.bytes_read == sizes
        assert_reads_match(source, expected_state(ckpts["bin_index"]), seed=5, exact_bytes=False)
        assert source.bytes_read == sizes  # not downloaded again
        scratch = source._scratch._dir
        assert scratch is not None and len(os.listdir(scratch.name)) == 3
        kept = scratch.name
    assert not os.path.exists(kept)


def test_a_store_error_mid_read_names_the_file_and_tensor(
    ckpts: dict[str, Path], memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = upload(ckpts["single"], f"{memory_url}/single")
    fs, path = fsspec.core.url_to_fs(url)
    with open_source(url) as source:
        monkeypatch.setattr(fs, "cat_ranges", lambda paths, *a, **k: [ConnectionError("reset")] * len(paths))
        i64 = source.tensors["i64"]
        with pytest.raises(CheckpointError, match=rf"{url}/model.safetensors.*read tensor 'i64'.*reset"):
            source.read([(i64, 0, torch.empty(3, dtype=torch.int64))])
        monkeypatch.undo()
        fs.pipe_file(f"{path}/model.safetensors", fs.cat_file(f"{path}/model.safetensors")[:200])  # shrank
        with pytest.raises(
            CheckpointError,
            match="Reading tensor 'u16' from .*model.safetensors failed: the file ends before byte",
        ):
            source.read([(source.tensors["u16"], 0, torch.empty(12, dtype=torch.uint16))])


# ----------------------------------------------------------------------------------- errors at open
def test_missing_path_and_url(tmp_path: Path, memory_url: str) -> None:
    with pytest.raises(CheckpointError, match="nope does not exist. HINT"):
        open_source(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_source(f"{memory_url}/nope")


def test_directory_without_a_checkpoint_lists_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    safetensors.torch.save_file({"a": torch.ones(2)}, tmp_path / "adapter_model.safetensors")
    (tmp_path / "unet").mkdir()
    with pytest.raises(CheckpointError) as info:
        open_source(tmp_path)
    text = str(info.value)
    assert "none of model.safetensors" in text and "'config.json'" in text and "'unet/'" in text
    assert (
        f"HINT: pass the path of the checkpoint file or index to read, e.g. {tmp_path}/adapter_model" in text
    )


def test_index_naming_a_missing_file(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(ckpts["llama"], tmp_path / "llama")
    gone = sorted(folder.glob("model-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"names the file '{gone.name}'.*which is not in {folder}"):
        open_source(folder)


def test_index_naming_a_tensor_absent_from_its_file(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(ckpts["llama"], tmp_path / "llama")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first_file = sorted(set(data["weight_map"].values()))[0]
    data["weight_map"]["model.ghost.weight"] = first_file
    index.write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=rf"tensor 'model.ghost.weight' in .*{first_file}, which does not hold"
    ):
        open_source(folder)
    moved = next(n for n, f in data["weight_map"].items() if f == first_file and n != "model.ghost.weight")
    del data["weight_map"]["model.ghost.weight"]
    data["weight_map"][moved] = sorted(set(data["weight_map"].values()))[-1]
    index.write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=rf"tensor '{moved}' in .*which does not hold it \(it is in .*{first_file}\)"
    ):
        open_source(folder)
    index.write_text('{"weights": {}}')
    with pytest.raises(CheckpointError, match="is not a Hugging Face index"):
        open_source(folder)


def test_a_tensor_in_two_files(tmp_path: Path) -> None:
    safetensors.torch.save_file({"a": torch.ones(2), "b": torch.ones(1)}, tmp_path / "one.safetensors")
    safetensors.torch.save_file({"a": torch.zeros(2)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"Tensor 'a' is in both .*one.safetensors and .*two.safetensors"
    ):
        open_source(tmp_path)


def _write_raw(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_damaged_headers(tmp_path: Path) -> None:
    garbled = _write_raw(tmp_path / "a" / "model.safetensors", b'{"x": {"dtype": "F32", "sha')
    with pytest.raises(
        CheckpointError, match=rf"{garbled}: the header is not valid JSON.*HINT: the file is damaged"
    ):
        open_source(garbled.parent)
    huge = tmp_path / "b" / "model.safetensors"
    huge.parent.mkdir()
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CheckpointError, match="header length of .* is not a safetensors file's"):
        open_source(huge)
    short = tmp_path / "c.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short for a safetensors header"):
        open_source(short)
    past = tmp_path / "d.safetensors"
    past.write_bytes(struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(CheckpointError, match="needs 4096 bytes.*truncated.*HINT: the file is incomplete"):
        open_source(past)
    shape = _write_raw(
        tmp_path / "e.safetensors", b'{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', bytes(8)
    )
    with pytest.raises(CheckpointError, match="tensor 'w' .* claims bytes"):
        open_source(shape)


def test_truncated_file_and_unknown_dtype(ckpts: dict[str, Path], tmp_path: Path) -> None:
    raw = (ckpts["single"] / "model.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-10])
    with pytest.raises(
        CheckpointError, match=rf"{cut}: {len(raw) - 10} bytes, but '.*' ends at byte {len(raw)}"
    ):
        open_source(cut)
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(raw.replace(b'"U16"', b'"Q16"', 1))
    with pytest.raises(CheckpointError, match=r"tensor 'u16' has dtype 'Q16'.*HINT: convert that tensor"):
        open_source(odd)


def test_bin_files_that_cannot_be_read_lazily(ckpts: dict[str, Path], tmp_path: Path) -> None:
    legacy = tmp_path / "legacy" / "pytorch_model.bin"
    legacy.parent.mkdir()
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(
        CheckpointError, match=rf"{legacy} is not a zip-format torch.save file.*HINT: convert"
    ):
        open_source(legacy.parent)
    raw = (ckpts["bin_single"] / "pytorch_model.bin").read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=rf"{cut} could not be loaded as a torch.save state dict"):
        open_source(cut)
    nested = tmp_path / "nested.bin"
    torch.save({"a": {"b": torch.ones(1)}}, nested)
    with pytest.raises(CheckpointError, match="entry 'a' is a dict, not a tensor"):
        open_source(nested)
    (tmp_path / "model.onnx").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="neither a .safetensors file"):
        open_source(tmp_path / "model.onnx")


# ----------------------------------------------------------------------------------- errors mid-read
def test_a_file_that_shrinks_after_open(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = shutil.copy(ckpts["single"] / "model.safetensors", tmp_path / "model.safetensors")
    header = _header(path)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    with open_source(path) as source:
        os.truncate(path, os.path.getsize(path) - 4)
        whole = [(t, 0, torch.empty(t.numel, dtype=t.dtype)) for t in source.tensors.values()]
        with pytest.raises(
            CheckpointError, match=rf"Reading tensor '{last}' from {path} failed: the file ends before"
        ):
            source.read(whole)
    folder = shutil.copytree(ckpts["bin_single"], tmp_path / "bin")
    with open_source(folder) as source:
        f32 = source.tensors["f32"]
        os.truncate(folder / "pytorch_model.bin", 100)
        with pytest.raises(CheckpointError, match="pytorch_model.bin changed since it was opened"):
            source.read([(f32, 0, torch.empty(1))])


def test_an_io_error_mid_read_names_the_file_and_tensor(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(5, "Input/output error")

    with open_source(ckpts["single"]) as source:
        monkeypatch.setattr(os, "preadv", failing)
        bf16 = source.tensors["bf16"]
        with pytest.raises(
            CheckpointError, match=r"Reading tensor 'bf16' from .*model.safetensors failed \(OSError"
        ):
            source.read([(bf16, 3, torch.empty(5, dtype=torch.bfloat16))])
