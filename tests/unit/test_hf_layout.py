"""Hugging Face's multi-file safetensors layout without processes: the size limit, the split into files (the same
as huggingface_hub's), the streaming writer (any arrival order, atomic, stale files removed, the user's files
kept), ``full_entries`` against the full state dict, ``save_pretrained`` on one process, and ``flatshard
consolidate SRC OUT_DIR/``. Two ranks and Hugging Face models are in ``tests/hf/test_save_pretrained.py``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.checkpoint import CheckpointError, locate, output_format, parse_dtype, parse_max_shard_size
from flatshard.checkpoint import hf_export as layout
from flatshard.checkpoint.files import atomic_save
from flatshard.checkpoint.hf_export import (
    INDEX_NAME,
    WEIGHTS_NAME,
    PretrainedWriter,
    TensorSpec,
    plan_shards,
)
from flatshard.cli import main
from flatshard.engine import MixedPrecision, full_entries
from flatshard.testing.models import Block, TinyGPT

safetensors_torch = pytest.importorskip("safetensors.torch")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("100KB", 100 * 10**3),
        ("2TB", 2 * 10**12),
        ("5GiB", 5 * 2**30),
        ("64MiB", 64 * 2**20),
        ("1KiB", 1024),
        ("1.5GB", 1_500_000_000),
        ("5gb", 5 * 10**9),
        (" 7 MB ", 7 * 10**6),
        ("4096", 4096),
        ("10B", 10),
        (123, 123),
    ],
)
def test_sizes_read_as_hugging_face_writes_them(text: int | str, expected: int) -> None:
    assert parse_max_shard_size(text) == expected


@pytest.mark.parametrize("text", ["5GB", "500MB", "100KB", "1.5GB", "5gb", "2TB", " 7 MB "])
def test_decimal_units_agree_with_huggingface_hub(text: str) -> None:
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    assert parse_max_shard_size(text) == hub.parse_size_to_int(text)


@pytest.mark.parametrize("bad", ["5XB", "GB", "", "-1GB", "1.5", "five GB", 0, -3, True, 1.5, None])
def test_bad_sizes_are_refused_naming_the_value(bad: Any) -> None:
    with pytest.raises(ValueError, match="HINT") as raised:
        parse_max_shard_size(bad)
    assert repr(bad) in str(raised.value)


def test_dtype_names_and_refusals() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float32) is torch.float32 and parse_dtype(None) is None
    for bad in ("int8", "float128", torch.int64):
        with pytest.raises(ValueError, match="HINT"):
            parse_dtype(bad)


# ---------------------------------------------------------------------------------------------- planning
def _random_specs(rng: random.Random, n: int) -> list[TensorSpec]:
    specs = []
    for i in range(n):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.choice([0, 1, 3, 7, 16, 40, 100]) for _ in range(rng.randint(0, 2)))
        specs.append(TensorSpec(f"layer.{i}.w", dtype, shape))
    return specs


def test_files_are_split_as_huggingface_hub_splits_them() -> None:
    hub = pytest.importorskip("huggingface_hub")
    rng = random.Random(0)
    for case in range(150):
        specs = _random_specs(rng, rng.randint(1, 25))
        limit = rng.choice([1, 8, 50, 100, 400, 1000, 10**6])
        state = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}  # each its own storage
        split = hub.split_torch_state_dict_into_shards(state, max_shard_size=limit)
        plan = plan_shards(specs, limit)
        ours = {f.name: {t.name for t in f.tensors} for f in plan.files}  # the order inside a file is free
        theirs = {name: set(names) for name, names in split.filename_to_tensors.items()}
        assert list(ours) == list(theirs) and ours == theirs, (case, limit, [s.nbytes for s in specs])
        assert plan.weight_map == split.tensor_to_filename
        assert plan.is_sharded == split.is_sharded
        assert plan.total_size == split.metadata["total_size"]


def test_a_tensor_over_the_limit_gets_a_file_of_its_own_placed_when_met() -> None:
    specs = [TensorSpec(n, torch.uint8, (size,)) for n, size in [("a", 3), ("big", 10), ("c", 2), ("d", 1)]]
    plan = plan_shards(specs, 5)
    assert [[t.name for t in f.tensors] for f in plan.files] == [["big"], ["a", "c"], ["d"]]
    assert [f.name for f in plan.files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = plan.index()
    assert index is not None and index["metadata"] == {"total_size": 16}
    one = plan_shards(specs, "1GB")
    assert [f.name for f in one.files] == [WEIGHTS_NAME] and one.index() is None


def test_files_lay_out_tensors_in_arrival_order() -> None:
    specs = [TensorSpec(n, torch.float32, (4,)) for n in "abcd"]
    plan = plan_shards(specs, 32, arrival={"a": 3, "b": 0, "c": 2, "d": 1})
    assert [[t.name for t in f.tensors] for f in plan.files] == [["b", "a"], ["d", "c"]]
    assert plan.weight_map == {
        "a": plan.files[0].name,
        "b": plan.files[0].name,
        "c": plan.files[1].name,
        "d": plan.files[1].name,
    }


# ---------------------------------------------------------------------------------------------- writing
def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(10, 8, generator=g),
        "layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(8, generator=g),
        "layers.1.w": torch.randn(8, 8, generator=g).t(),  # not contiguous
        "layers.1.mask": torch.rand(8, generator=g) > 0.5,
        "steps": torch.tensor(7),
        "norm.weight": torch.randn(8, generator=g).to(torch.float16),
    }


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]


def _export(
    out: Any, tensors: dict[str, torch.Tensor], limit: int | str, order: list[str] | None = None
) -> Any:
    plan = plan_shards(_specs(tensors), limit)
    with PretrainedWriter(locate(out), plan) as writer:
        for name in order or list(tensors):
            writer.write(name, tensors[name])
        return writer.finish()


def _read(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / INDEX_NAME
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else [WEIGHTS_NAME]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(safetensors_torch.load_file(directory / name))
    return out


def _snapshot(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _hidden(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if n.startswith(".")]


def test_tensors_arriving_in_any_order_are_written_and_read_back(tmp_path: Path) -> None:
    tensors = _tensors()
    order = list(tensors)
    random.Random(1).shuffle(order)
    out = _export(tmp_path / "model", tensors, 300, order)
    assert out == tmp_path / "model"
    names = sorted(os.listdir(out))
    assert INDEX_NAME in names and len(names) > 3
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())}
    assert set(index["weight_map"]) == set(tensors)
    read = _read(out)
    for name, value in tensors.items():
        assert torch.equal(read[name], value), name
    for name in set(index["weight_map"].values()):
        with safetensors_torch.safe_open(out / name, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert _hidden(tmp_path) == []


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, f: Any, room: list[int]) -> None:
        self._f, self._room = f, room

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room[0] -= n
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _fill_disk_after(monkeypatch: pytest.MonkeyPatch, room: int) -> None:
    left = [room]
    real = layout._LocalTarget.open
    monkeypatch.setattr(layout._LocalTarget, "open", lambda self, name: _FullDisk(real(self, name), left))


def test_a_failed_write_leaves_no_directory_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill_disk_after(monkeypatch, 400)
    with pytest.raises(
        CheckpointError, match=r"model-0000\d-of-0000\d\.safetensors: No space left.*HINT"
    ) as raised:
        _export(tmp_path / "model", _tensors(), 300)
    assert isinstance(raised.value.__cause__, OSError)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_failed_write_leaves_the_previous_export_and_user_files_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"
    _export(out, _tensors(0), 300)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "README.md").write_text("# my model\n")
    before = _snapshot(out)
    _fill_disk_after(monkeypatch, 200)
    for limit in (300, 10**6):  # the same file names, and one file replacing several
        with pytest.raises(CheckpointError, match="No space left"):
            _export(out, _tensors(1), limit)
        assert _snapshot(out) == before
        assert _hidden(tmp_path) == []


def test_stale_weight_files_go_user_files_stay(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    user = {"config.json": "{}", "tokenizer.json": "{}", "README.md": "hi", "model-card.safetensors.txt": "x"}
    for name, text in user.items():
        (out / name).write_text(text)
    _export(out, _tensors(0), 300)
    several = sorted(os.listdir(out))
    assert INDEX_NAME in several and set(user) <= set(several)
    _export(out, _tensors(1), "1GB")  # one file now: the shards and the index go
    assert sorted(os.listdir(out)) == sorted([*user, WEIGHTS_NAME])
    assert all(torch.equal(_read(out)[k], v) for k, v in _tensors(1).items())
    _export(out, _tensors(2), 200)  # several again: model.safetensors goes
    assert WEIGHTS_NAME not in os.listdir(out) and INDEX_NAME in os.listdir(out)
    assert all(torch.equal(_read(out)[k], v) for k, v in _tensors(2).items())
    assert {n: (out / n).read_text() for n in user} == user
    assert _hidden(tmp_path) == [] and not [n for n in os.listdir(out) if n.startswith(".")]


def test_a_file_or_a_sharded_checkpoint_in_the_way_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "model"
    taken.write_text("not a directory")
    with pytest.raises(CheckpointError, match="a file of that name exists.*HINT"):
        _export(taken, _tensors(), 300)
    sharded = tmp_path / "ckpt"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="sharded checkpoint"):
        _export(sharded, _tensors(), 300)
    assert sorted(os.listdir(sharded)) == [".metadata"] and _hidden(tmp_path) == []


def test_a_wrong_tensor_is_refused_and_nothing_is_put_in_place(tmp_path: Path) -> None:
    tensors = _tensors()
    plan = plan_shards(_specs(tensors), 300)
    with pytest.raises(CheckpointError, match="planned as"):
        with PretrainedWriter(locate(tmp_path / "m"), plan) as writer:
            writer.write("embed.weight", tensors["embed.weight"].double())
    with pytest.raises(CheckpointError, match="never arrived"):
        with PretrainedWriter(locate(tmp_path / "m"), plan) as writer:
            writer.write("steps", tensors["steps"])
            writer.finish()
    assert os.listdir(tmp_path) == []


def test_a_url_gets_final_names_the_index_and_no_stale_objects() -> None:
    url = "memory://flatshard-hf-layout/model"
    fs = locate(url).fs  # type: ignore[union-attr]
    fs.pipe_file("/flatshard-hf-layout/model/config.json", b"{}")
    assert _export(url, _tensors(0), 300) == url
    first = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/flatshard-hf-layout/model", detail=False))
    assert INDEX_NAME in first and "config.json" in first
    _export(url, _tensors(1), "1GB")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/flatshard-hf-layout/model", detail=False)) == [
        "config.json",
        WEIGHTS_NAME,
    ]
    read = safetensors_torch.load(fs.cat_file(f"/flatshard-hf-layout/model/{WEIGHTS_NAME}"))
    assert all(torch.equal(read[k], v) for k, v in _tensors(1).items())
    fs.rm("/flatshard-hf-layout", recursive=True)


# ---------------------------------------------------------------------------------------------- full_entries
class _Buffers(nn.Module):
    """TinyGPT beside a float buffer (persistent) and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"auto_wrap_policy": {Block}},
        {
            "auto_wrap_policy": {Block},
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
        },
    ],
    ids=["root", "blocks", "buffers-cast"],
)
def test_full_entries_describe_the_full_state_dict(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = _Buffers()
    plain = full_entries(model)
    flatshard.shard(model, **options)
    entries = full_entries(model)
    full, _ = flatshard.get_state_dict(model)
    assert [e.key for e in entries] == list(full) == [e.key for e in plain]
    for e in entries:
        assert (e.dtype, e.shape) == (full[e.key].dtype, full[e.key].shape), e.key
    tied = {e.key: e.first for e in entries if e.first != e.key}
    assert (
        tied
        == {"model.head.weight": "model.wte.weight"}
        == {e.key: e.first for e in plain if e.first != e.key}
    )
    assert {e.key for e in entries if not e.parameter} == {"model.steps", "scale"}
    arrival = {e.key: e.arrival for e in entries}
    assert arrival["model.head.weight"] == arrival["model.wte.weight"]
    whole = [
        arrival["scale"],
        arrival["model.steps"],
    ]  # returned whole, after every unit, in state-dict order
    assert whole == sorted(whole) and min(whole) > max(
        a for k, a in arrival.items() if k not in ("scale", "model.steps")
    )


# ---------------------------------------------------------------------------------------------- save_pretrained
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_save_pretrained_on_one_process(tmp_path: Path, sharded: bool) -> None:
    torch.manual_seed(0)
    model = _Buffers()
    expected = {
        k[len("model.") :]: v.clone() for k, v in model.state_dict().items() if k.startswith("model.")
    }
    if sharded:
        flatshard.shard(model, auto_wrap_policy={Block})
    out = flatshard.save_pretrained(model, tmp_path / "hf", prefix="model.", max_shard_size="1KB")
    assert out == tmp_path / "hf"
    read = _read(out)
    assert sorted(read) == sorted(set(expected) - {"head.weight"})  # tied: stored once, under the first name
    for name, value in read.items():
        assert torch.equal(value, expected[name]), name
    index = json.loads((out / INDEX_NAME).read_text())
    params = sum(v.numel() for k, v in expected.items() if k not in ("head.weight", "steps"))
    assert index["metadata"] == {
        "total_parameters": params,
        "total_size": sum(v.nbytes for v in read.values()),
    }

    whole = flatshard.save_pretrained(model, tmp_path / "all", dtype="bfloat16")
    assert isinstance(whole, Path) and sorted(os.listdir(whole)) == [WEIGHTS_NAME]
    read = safetensors_torch.load_file(whole / WEIGHTS_NAME)
    assert (
        "cache" not in read
        and read["scale"].dtype == torch.bfloat16
        and read["model.steps"].dtype == torch.long
    )
    assert torch.equal(read["model.wte.weight"], expected["wte.weight"].to(torch.bfloat16))


def test_save_pretrained_refuses_a_prefix_that_selects_nothing(tmp_path: Path) -> None:
    model = _Buffers()
    with pytest.raises(CheckpointError, match=r"'net\.'.*\['scale', 'model\.'\]"):
        flatshard.save_pretrained(model, tmp_path / "hf", prefix="net.")
    with pytest.raises(CheckpointError, match="end the prefix with '.'"):
        flatshard.save_pretrained(model, tmp_path / "hf", prefix="model")
    with pytest.raises(ValueError, match="'3XB'"):
        flatshard.save_pretrained(model, tmp_path / "hf", max_shard_size="3XB")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- the command
def test_output_format_picks_a_directory_for_a_trailing_slash(tmp_path: Path) -> None:
    assert output_format(f"{tmp_path}/hf/") == "/"
    (tmp_path / "existing").mkdir()
    assert output_format(tmp_path / "existing") == "/"
    (tmp_path / "dir.safetensors").mkdir()
    assert output_format(tmp_path / "dir.safetensors") == ".safetensors"  # refused when written, as before
    with pytest.raises(CheckpointError, match="with '/' for a Hugging Face model directory"):
        output_format(tmp_path / "missing")


def test_consolidate_a_full_file_into_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    state = {f"model.{k}": v for k, v in TinyGPT().state_dict().items()}
    src = tmp_path / "last.ckpt"
    atomic_save({"epoch": 0, "state_dict": state}, src)
    out = tmp_path / "hf"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    argv = [
        "consolidate",
        str(src),
        f"{out}/",
        "--prefix",
        "model.",
        "--max-shard-size",
        "2KB",
        "--dtype",
        "bf16",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "files" in printed and "head.weight -> wte.weight" in printed
    read = _read(out)
    assert sorted(read) == sorted(k[len("model.") :] for k in state if k != "model.head.weight")
    for name, value in read.items():
        original = state[f"model.{name}"]
        assert torch.equal(
            value, original.to(torch.bfloat16) if original.is_floating_point() else original
        ), name
    assert (out / "config.json").read_text() == "{}" and (out / "sub").is_dir()

    assert main(["consolidate", str(src), str(tmp_path / "x.ckpt"), "--max-shard-size", "1GB"]) == 2
    assert "end the output with '/'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["consolidate", str(src), f"{out}/", "--max-shard-size", "12 parsecs"])
    assert "'12 parsecs'" in capsys.readouterr().err
    assert flatshard.consolidate(src, f"{tmp_path}/plain/") == tmp_path / "plain"
    assert sorted(os.listdir(tmp_path / "plain")) == [WEIGHTS_NAME]
