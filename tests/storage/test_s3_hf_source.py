"""Hugging Face checkpoints read by byte range from ``s3://`` URLs on a real S3-compatible server (see
conftest.py): a ``save_pretrained`` multi-file ``.safetensors`` checkpoint read range by range with exactly the
requested bytes fetched, a ``.bin`` checkpoint downloaded once, and the errors for a missing URL, a missing file
named by an index and an unreachable endpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flatshard.checkpoint import CheckpointError
from flatshard.checkpoint.hf_source import open_source
from flatshard.testing import find_free_port

from ..unit.test_hf_source import assert_reads_match, expected_state, save_bin_index, save_llama, tiny_llama
from .conftest import S3Server, other_endpoint


def _upload(server: S3Server, folder: Path, url: str) -> str:
    fs = server.fs()
    for path in sorted(folder.iterdir()):
        fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.name}")
    fs.invalidate_cache()
    return url


@pytest.mark.slow
def test_safetensors_index_read_by_range_from_s3(s3_server: S3Server, s3_url: str, tmp_path: Path) -> None:
    local = save_llama(tmp_path / "llama")
    url = _upload(s3_server, local, f"{s3_url}/llama")
    with open_source(url) as source:
        assert source.notes == [] and len({t.file for t in source.tensors.values()}) > 2
        assert all(t.file.startswith(f"{url}/model-") for t in source.tensors.values())
        assert_reads_match(source, expected_state(local))  # exactly the requested bytes fetched
        assert_reads_match(source, expected_state(local), seed=7)
    with open_source(f"{url}/model.safetensors.index.json") as source:
        assert_reads_match(source, expected_state(local), seed=8)


def test_bin_checkpoint_is_downloaded_once_from_s3(s3_server: S3Server, s3_url: str, tmp_path: Path) -> None:
    local = save_bin_index(tmp_path / "bin", tiny_llama().state_dict(), files=2)
    url = _upload(s3_server, local, f"{s3_url}/bin")
    size = sum(p.stat().st_size for p in local.glob("*.bin"))
    with open_source(url) as source:
        assert any("downloaded whole" in note for note in source.notes), source.notes
        assert_reads_match(source, expected_state(local), exact_bytes=False)
        assert_reads_match(source, expected_state(local), seed=9, exact_bytes=False)
        assert source.bytes_read == size


def test_missing_url_and_missing_file(s3_server: S3Server, s3_url: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"{s3_url}/nothing does not exist"):
        open_source(f"{s3_url}/nothing")
    local = save_llama(tmp_path / "llama")
    url = _upload(s3_server, local, f"{s3_url}/llama")
    gone = sorted(local.glob("model-*.safetensors"))[0].name
    s3_server.fs().rm_file(f"{url.removeprefix('s3://')}/{gone}")
    with pytest.raises(CheckpointError, match=rf"names the file '{gone}'.*which is not in {url}"):
        open_source(url)


@pytest.mark.timeout(60)
def test_an_unreachable_endpoint_fails_at_open(s3_url: str) -> None:
    dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    start = time.monotonic()
    with other_endpoint(dead, AWS_MAX_ATTEMPTS="1"), pytest.raises(CheckpointError) as info:
        open_source(f"{s3_url}/llama")
    assert time.monotonic() - start < 45
    assert f"{s3_url}/llama: could not reach it" in str(info.value) and "HINT" in str(info.value)
