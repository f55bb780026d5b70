"""``flatshard.save_pretrained`` of a tiny Llama sharded on 2 ranks, and ``flatshard consolidate CKPT OUT_DIR/``,
give the directory transformers' ``save_pretrained`` gives.

Two gloo ranks shard a random-config ``LlamaForCausalLM`` (head tied to the embedding and not) with one unit per
decoder layer and write it with a small ``max_shard_size``, so several files and an index result; the same spawn
writes a LightningModule-like holder (``prefix="model."``, ``dtype=bfloat16``), a full and a sharded checkpoint,
an export whose writes fail on rank 0 (every rank raises, the previous export stays), and the model at an
``s3://`` URL on the storage tier's local S3 server. Then, in this process: ``config.save_pretrained(OUT)`` and
``AutoModelForCausalLM.from_pretrained(OUT)`` give the unsharded reference's state bit for bit and its logits; the
index is byte for byte the one transformers writes for the reference; the checkpoints consolidate into the same
directory, locally and from S3 to S3.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import flatshard
from flatshard.checkpoint import CheckpointError
from flatshard.checkpoint import hf_export as layout
from flatshard.cli import main
from flatshard.testing import spawn
from tests.storage.conftest import S3Server, s3_server  # noqa: F401  (the storage tier's S3 server)

from .hf_common import WEIGHT_TOL, build_config, prompt

pytestmark = pytest.mark.slow

MAX_SHARD_SIZE = "20KB"  # the tiny Llama is about 90 kB: several files
INDEX = "model.safetensors.index.json"


def _config(tie: bool) -> Any:
    config = build_config("llama")
    config.tie_word_embeddings = tie
    return config


def _reference(tie: bool) -> LlamaForCausalLM:
    """The same random model on every rank and in this process."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tie))
    model.eval()
    return model


class _Holder(torch.nn.Module):
    """What a LightningModule holding the model as ``self.model`` looks like to a save."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _sharded(tie: bool) -> LlamaForCausalLM:
    model = _reference(tie)
    flatshard.shard(model, auto_wrap_policy={LlamaDecoderLayer})
    return model


def _snapshot(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


class _FullDisk:
    """Rank 0's files fail as on a full disk after the header."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._writes = 0

    def write(self, data: Any) -> int:
        self._writes += 1
        if self._writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _write(rank: int, world: int, out: str, url: str) -> dict[str, Any]:
    """Every save of the tests below, in one spawn (starting ranks that import transformers takes most of it)."""
    torch.set_num_threads(1)
    for tie in (True, False):
        written = flatshard.save_pretrained(_sharded(tie), f"{out}/tie-{tie}", max_shard_size=MAX_SHARD_SIZE)
        assert written == Path(out) / f"tie-{tie}"
    holder = _Holder(_reference(True))
    flatshard.shard(holder, auto_wrap_policy={LlamaDecoderLayer})
    flatshard.save_pretrained(
        holder, f"{out}/bf16", prefix="model.", max_shard_size=MAX_SHARD_SIZE, dtype="bf16"
    )
    flatshard.save_checkpoint(f"{out}/full.ckpt", holder)
    flatshard.save_checkpoint(f"{out}/sharded.ckpt", holder, state_dict_type="sharded")

    target = Path(out) / "tie-True"
    before = _snapshot(target) if rank == 0 else {}
    real_open = layout._LocalTarget.open
    failing = mock.patch.object(
        layout._LocalTarget, "open", lambda self, name: _FullDisk(real_open(self, name))
    )
    with failing if rank == 0 else contextlib.nullcontext():
        try:
            flatshard.save_pretrained(_sharded(True), target, max_shard_size="1GB")
            error = None
        except CheckpointError as err:
            error = str(err)
    unchanged = _snapshot(target) == before if rank == 0 else True
    hidden = [n for n in os.listdir(out) if n.startswith(".")]

    model = _sharded(True)
    flatshard.save_pretrained(model, f"{url}/llama", max_shard_size=MAX_SHARD_SIZE)
    fs = flatshard.checkpoint.locate(url).fs  # type: ignore[union-attr]
    objects = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/llama", detail=False, refresh=True))
    flatshard.save_checkpoint(f"{url}/sharded.ckpt", model, state_dict_type="sharded")
    return {"error": error, "unchanged": unchanged, "hidden": hidden, "objects": objects}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> dict[str, Any]:  # noqa: F811
    out = tmp_path_factory.mktemp("save_pretrained")
    url = f"s3://{s3_server.bucket}/save_pretrained-{uuid.uuid4().hex[:8]}"
    s3_server.fs().pipe_file(
        f"{url}/llama/config.json", _config(True).to_json_string().encode()
    )  # the user's
    results = spawn(_write, 2, str(out), url)
    for rank, result in enumerate(results):  # rank 0's write failed: every rank raised, nothing changed
        assert result["error"] is not None, rank
        assert "failed on rank 0" in result["error"] and "No space left on device" in result["error"], result
        assert "HINT:" in result["error"] and result["unchanged"] and result["hidden"] == [], result
    return {"dir": out, "url": url, "objects": results[0]["objects"]}


def _assert_same_model(directory: Path, tie: bool, dtype: torch.dtype = torch.float32) -> None:
    """``from_pretrained(directory)`` holds the reference's weights bit for bit and gives its logits."""
    _config(tie).save_pretrained(directory)
    loaded: Any = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    model, info = loaded
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference: Any = _reference(tie)
    reference.to(dtype)
    expected = reference.state_dict()
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].dtype == dtype and torch.equal(state[key], value), key
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    with torch.no_grad():
        logits = model.eval()(**prompt("llama")).logits
        expected_logits = reference(**prompt("llama")).logits
        torch.testing.assert_close(logits, expected_logits, atol=WEIGHT_TOL["atol"], rtol=WEIGHT_TOL["rtol"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_from_pretrained_reads_the_sharded_model_as_transformers_writes_it(
    written: dict[str, Any], tmp_path: Path, tie: bool
) -> None:
    directory = written["dir"] / f"tie-{tie}"
    files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    assert len(files) > 2 and INDEX in os.listdir(directory), files
    _reference(tie).save_pretrained(tmp_path / "transformers", max_shard_size=MAX_SHARD_SIZE)
    ours, theirs = (directory / INDEX).read_bytes(), (tmp_path / "transformers" / INDEX).read_bytes()
    assert ours == theirs  # the same files, the same names in each, the same totals
    if tie:
        assert "lm_head.weight" not in json.loads(ours)["weight_map"]
    _assert_same_model(directory, tie)


@pytest.mark.timeout(300)
def test_a_prefix_and_a_dtype(written: dict[str, Any]) -> None:
    directory = written["dir"] / "bf16"
    weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    assert (
        all(not k.startswith("model.model.") for k in weight_map)
        and "model.embed_tokens.weight" in weight_map
    )
    _assert_same_model(directory, tie=True, dtype=torch.bfloat16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_consolidate_a_checkpoint_into_a_model_directory(
    written: dict[str, Any], tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "llama"
    argv = ["consolidate", str(written["dir"] / f"{kind}.ckpt"), f"{out}/", "--prefix", "model."]
    assert main([*argv, "--max-shard-size", MAX_SHARD_SIZE]) == 0
    assert "lm_head.weight -> model.embed_tokens.weight" in capsys.readouterr().out
    ours = json.loads((out / INDEX).read_text())
    theirs = json.loads((written["dir"] / "tie-True" / INDEX).read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    _assert_same_model(out, tie=True)


@pytest.mark.timeout(300)
def test_an_s3_url(written: dict[str, Any], s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    """save_pretrained wrote several objects beside the user's config; consolidating a sharded checkpoint from
    S3 into the same URL replaces them with one file, the config kept."""
    assert INDEX in written["objects"] and "config.json" in written["objects"], written["objects"]
    assert len(written["objects"]) > 3, written["objects"]
    url = f"{written['url']}/llama"
    assert main(["consolidate", f"{written['url']}/sharded.ckpt", f"{url}/", "--max-shard-size", "1GB"]) == 0
    fs = s3_server.fs()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True)) == [
        "config.json",
        "model.safetensors",
    ]
    local = tmp_path / "llama"
    fs.get(f"{url}/", f"{local}/", recursive=True)
    _assert_same_model(local, tie=True)
