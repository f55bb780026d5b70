"""Checkpoints at ``s3://`` URLs on a real S3-compatible server (see conftest.py), without Lightning:
``flatshard.save_checkpoint`` / ``load_checkpoint`` (full files and sharded directories, on 2 ranks and in one
process), ``flatshard consolidate`` from and to S3, removal, atomic replacement, and the errors for an incomplete
directory, a missing bucket, an unreachable endpoint and a missing fsspec backend."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import flatshard
from flatshard import cli
from flatshard.checkpoint import CheckpointError, is_sharded_checkpoint, remote_dcp, remove_checkpoint
from flatshard.testing import find_free_port, spawn
from flatshard.testing.models import TinyGPT

from .conftest import S3Server, other_endpoint, trained_tinygpt


def _full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    return flatshard.get_state_dict(model, optimizer, rank0_only=False)


def _assert_same_state(
    actual: tuple[dict[str, Any], dict[str, Any]], expected: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    assert sorted(actual[0]) == sorted(expected[0])
    for key, value in expected[0].items():
        assert torch.equal(actual[0][key], value), key
    assert actual[1]["param_groups"] == expected[1]["param_groups"]
    for idx, entries in expected[1]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(actual[1]["state"][idx][key]), torch.as_tensor(value)), (
                idx,
                key,
            )


def _objects(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, refresh=True))


# ------------------------------------------------------------------------------------- 2 ranks
def _save_and_load_on_ranks(rank: int, world: int, url: str, cwd: str) -> dict[str, Any]:
    os.chdir(cwd)
    model, optimizer = trained_tinygpt()
    expected = _full_state(model, optimizer)
    out: dict[str, Any] = {}
    for kind in ("full", "sharded"):
        target = f"{url}/{kind}.ckpt"
        returned = flatshard.save_checkpoint(
            target, model, optimizer, state_dict_type=kind, extra={"step": 1}
        )
        fresh, fresh_optimizer = trained_tinygpt(seed=123, steps=0)
        extra = flatshard.load_checkpoint(target, fresh, fresh_optimizer)
        _assert_same_state(_full_state(fresh, fresh_optimizer), expected)
        out[kind] = {"returned": returned, "extra": extra, "sharded": is_sharded_checkpoint(target)}
    return out


@pytest.mark.timeout(60)
def test_full_and_sharded_checkpoints_round_trip_through_s3_on_two_ranks(
    s3_url: str, local_cwd: Path
) -> None:
    for rank in spawn(_save_and_load_on_ranks, 2, s3_url, str(local_cwd)):
        assert rank["full"] == {"returned": f"{s3_url}/full.ckpt", "extra": {"step": 1}, "sharded": False}
        assert rank["sharded"] == {
            "returned": f"{s3_url}/sharded.ckpt",
            "extra": {"step": 1},
            "sharded": True,
        }
    assert _objects(s3_url) == ["full.ckpt", "sharded.ckpt"]
    data = [o for o in _objects(f"{s3_url}/sharded.ckpt") if o.endswith(".distcp")]
    assert _objects(f"{s3_url}/sharded.ckpt") == sorted([".metadata", "meta.pt", *data]) and len(data) == 2


def _save_to_unreachable(rank: int, world: int, url: str, cwd: str) -> dict[str, str]:
    os.chdir(cwd)
    model, optimizer = trained_tinygpt(steps=0)
    out = {}
    for kind in ("full", "sharded"):
        try:
            flatshard.save_checkpoint(url, model, optimizer, state_dict_type=kind)
        except CheckpointError as err:
            out[kind] = str(err)
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_unreachable_endpoint_fails_on_every_rank_before_anything_is_written(
    s3_url: str, local_cwd: Path
) -> None:
    dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    start = time.monotonic()
    with other_endpoint(dead, AWS_MAX_ATTEMPTS="1"):  # one attempt per call: the error is the same, sooner
        ranks = spawn(_save_to_unreachable, 2, f"{s3_url}/ckpt", str(local_cwd))
    assert time.monotonic() - start < 45
    for rank in ranks:
        assert sorted(rank) == ["full", "sharded"], rank
        for message in rank.values():
            assert f"{s3_url}/ckpt" in message and "could not reach its storage" in message, message
            assert "HINT:" in message and "AWS_ENDPOINT_URL" in message, message
    assert not fsspec.filesystem("s3").exists(f"{s3_url}/ckpt")


# ------------------------------------------------------------------------------------- one process
def test_consolidate_from_s3_to_a_local_file_and_to_s3(s3_url: str, local_cwd: Path, tmp_path: Path) -> None:
    model, optimizer = trained_tinygpt(steps=2)
    expected_model, expected_optim = flatshard.get_state_dict(model, optimizer)
    src = f"{s3_url}/sharded.ckpt"
    flatshard.save_checkpoint(src, model, optimizer, state_dict_type="sharded", extra={"epoch": 3})
    local = tmp_path / "consolidated.ckpt"
    assert cli.main(["consolidate", src, str(local)]) == 0
    assert cli.main(["consolidate", src, f"{s3_url}/consolidated.ckpt"]) == 0
    with fsspec.open(f"{s3_url}/consolidated.ckpt", "rb") as f:
        remote = torch.load(f, weights_only=False)
    for ckpt in (torch.load(local, weights_only=False), remote):
        assert ckpt["epoch"] == 3
        assert sorted(ckpt["state_dict"]) == sorted(expected_model)
        for key, value in expected_model.items():
            assert torch.equal(ckpt["state_dict"][key], value), key
        plain = torch.optim.AdamW(TinyGPT().parameters(), lr=1e-2)
        plain.load_state_dict(ckpt["optimizer_states"][0])  # the plain optimizer format
        for idx, entries in expected_optim["state"].items():
            assert torch.equal(ckpt["optimizer_states"][0]["state"][idx]["exp_avg"], entries["exp_avg"])
    assert cli.main(["inspect", src]) == 0


def test_replacing_a_checkpoint_on_s3_keeps_the_old_one_until_the_new_metadata_is_written(
    s3_url: str, local_cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3_url}/last.ckpt"
    old_model, old_optimizer = trained_tinygpt(steps=1)
    flatshard.save_checkpoint(url, old_model, old_optimizer, state_dict_type="sharded", extra={"step": 1})
    new_model, new_optimizer = trained_tinygpt(steps=2)

    def killed(self: Any, metadata: Any, results: Any) -> None:
        raise RuntimeError("killed before the metadata was written")

    with monkeypatch.context() as mp:
        mp.setattr(remote_dcp.RemoteWriter, "finish", killed)
        with pytest.raises(
            CheckpointError, match="failed on rank 0: RuntimeError: killed before the metadata"
        ):
            flatshard.save_checkpoint(
                url, new_model, new_optimizer, state_dict_type="sharded", extra={"step": 2}
            )
    # The failed save removed its data objects; the old metadata names the old ones: the old checkpoint.
    assert len([o for o in _objects(url) if o.endswith(".distcp")]) == 1
    fresh, fresh_optimizer = trained_tinygpt(seed=123, steps=0)
    assert flatshard.load_checkpoint(url, fresh, fresh_optimizer) == {"step": 1}
    _assert_same_state(_full_state(fresh, fresh_optimizer), _full_state(old_model, old_optimizer))
    # The next complete save replaces it and removes the data objects of the earlier saves (only those).
    fsspec.filesystem("s3").pipe_file(f"{url}/notes.txt", b"not flatshard's")
    flatshard.save_checkpoint(url, new_model, new_optimizer, state_dict_type="sharded", extra={"step": 2})
    data = [o for o in _objects(url) if o.endswith(".distcp")]
    assert _objects(url) == sorted([".metadata", "meta.pt", "notes.txt", *data]) and len(data) == 1
    assert flatshard.load_checkpoint(url, fresh, fresh_optimizer) == {"step": 2}
    _assert_same_state(_full_state(fresh, fresh_optimizer), _full_state(new_model, new_optimizer))
    remove_checkpoint(url)
    assert not fsspec.filesystem("s3").exists(url)


def test_a_failed_full_file_upload_leaves_the_previous_file(
    s3_url: str, local_cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3_url}/full.ckpt"
    model, optimizer = trained_tinygpt(steps=1)
    flatshard.save_checkpoint(url, model, optimizer, extra={"step": 1})
    from flatshard.checkpoint import stream_save

    real_writer = stream_save.StreamedTorchFile

    def interrupted(f: Any) -> Any:  # the streamed writer (see [Note: streamed full saves]) fails midway
        f.write(b"\0" * (6 << 20))  # more than one upload part
        raise RuntimeError("interrupted mid-upload")

    with monkeypatch.context() as mp:
        mp.setattr(stream_save, "StreamedTorchFile", interrupted)
        with pytest.raises(CheckpointError, match="could not write it"):
            flatshard.save_checkpoint(url, model, optimizer, extra={"step": 2})
    assert stream_save.StreamedTorchFile is real_writer
    fresh, fresh_optimizer = trained_tinygpt(seed=123, steps=0)
    assert flatshard.load_checkpoint(url, fresh, fresh_optimizer) == {"step": 1}


def test_an_incomplete_sharded_directory_on_s3_is_refused(s3_url: str, local_cwd: Path) -> None:
    url = f"{s3_url}/interrupted.ckpt"
    model, optimizer = trained_tinygpt()
    flatshard.save_checkpoint(url, model, optimizer, state_dict_type="sharded")
    fsspec.filesystem("s3").rm_file(f"{url}/.metadata")  # as a save that died before writing it leaves it
    assert not is_sharded_checkpoint(url)
    before = _full_state(model, optimizer)
    for load in (
        lambda: flatshard.load_checkpoint(url, model, optimizer),
        lambda: flatshard.consolidate(url, f"{s3_url}/out.ckpt"),
    ):
        with pytest.raises(CheckpointError) as info:
            load()
        message = str(info.value)
        assert url in message and "incomplete" in message and "no .metadata object" in message, message
        assert "HINT:" in message, message
    _assert_same_state(_full_state(model, optimizer), before)
    assert cli.main(["consolidate", url, f"{s3_url}/out.ckpt"]) == 2
    assert "out.ckpt" not in _objects(s3_url)


def test_a_missing_bucket_is_refused_and_not_created(s3_server: S3Server, local_cwd: Path) -> None:
    model, optimizer = trained_tinygpt(steps=0)
    for kind in ("full", "sharded"):
        with pytest.raises(CheckpointError) as info:
            flatshard.save_checkpoint(
                "s3://no-such-bucket/run/x.ckpt", model, optimizer, state_dict_type=kind
            )
        message = str(info.value)
        assert "s3://no-such-bucket/run/x.ckpt" in message and "'no-such-bucket' does not exist" in message
        assert "HINT: create the bucket first" in message
    assert not s3_server.fs().exists("no-such-bucket")
    with pytest.raises(CheckpointError, match="names a whole bucket"):
        flatshard.save_checkpoint(f"s3://{s3_server.bucket}", model, optimizer, state_dict_type="sharded")
    with pytest.raises(CheckpointError, match="'no-such-bucket' does not exist"):
        flatshard.load_checkpoint("s3://no-such-bucket/run/x.ckpt", model, optimizer)


def test_a_missing_checkpoint_url_is_reported(s3_url: str, local_cwd: Path) -> None:
    model, optimizer = trained_tinygpt(steps=0)
    with pytest.raises(FileNotFoundError, match=f"Checkpoint {s3_url}/absent.ckpt does not exist"):
        flatshard.load_checkpoint(f"{s3_url}/absent.ckpt", model, optimizer)


def test_a_url_without_its_fsspec_backend_is_refused(local_cwd: Path) -> None:
    from fsspec.registry import known_implementations

    missing = [
        protocol
        for protocol, spec in known_implementations.items()
        if "err" in spec and importlib.util.find_spec(spec["class"].split(".")[0]) is None
    ]
    if not missing:
        pytest.skip("every fsspec backend is installed here")
    protocol = missing[0]
    model, optimizer = trained_tinygpt(steps=0)
    with pytest.raises(CheckpointError) as info:
        flatshard.save_checkpoint(f"{protocol}://bucket/run", model, optimizer, state_dict_type="sharded")
    message = str(info.value)
    assert (
        f"{protocol}://bucket/run" in message
        and "no fsspec backend" in message
        and "HINT: install" in message
    )


def test_a_url_collapsed_by_pathlib_is_refused(local_cwd: Path) -> None:
    model, optimizer = trained_tinygpt(steps=0)
    for path in (Path("s3://bucket/run/last.ckpt"), "s3:/bucket/run/last.ckpt", local_cwd / "s3:" / "bucket"):
        with pytest.raises(CheckpointError, match="whose '//' was collapsed"):
            flatshard.save_checkpoint(path, model, optimizer, state_dict_type="sharded")
        with pytest.raises(CheckpointError, match="whose '//' was collapsed"):
            flatshard.load_checkpoint(path, model, optimizer)


# ------------------------------------------------------------------------------------- multipart
WIDE = 1024  # Linear units of 4 MiB, 12 MiB with AdamW's two states


def _streamed_upload(rank: int, world: int, url: str, cwd: str, layers: int) -> dict[str, Any]:
    os.chdir(cwd)
    # s3fs's part size, as FSSPEC_S3_DEFAULT_BLOCK_SIZE would set it (set here: ranks may be forked from a
    # process that read the environment before this test)
    fsspec.config.conf.setdefault("s3", {})["default_block_size"] = 5 << 20
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = flatshard.shard(
        torch.nn.Sequential(*[torch.nn.Linear(WIDE, WIDE, bias=False) for _ in range(layers)]),
        auto_wrap_policy={torch.nn.Linear},
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDE, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    # Blocks of 1 MiB and more get mappings of their own and go back when freed: glibc's moving threshold would
    # otherwise keep freed part buffers in the heap, a measure of the allocator rather than of the upload.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    flatshard.save_checkpoint(url, model, optimizer)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return {"growth_mib": (peak - before) / 1024, "state": _full_state(model, optimizer)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_streamed_full_save_uploads_in_parts_as_it_is_written(s3_url: str, local_cwd: Path) -> None:
    """The file goes up as a multipart upload, a part at a time while the units are gathered (s3fs's block size,
    5 MiB here), committed only when complete: the writing rank's memory is a unit and a few parts, the same for
    a file twice as large, never the file."""
    growth, sizes = [], []
    for layers in (6, 12):
        url = f"{s3_url}/full-{layers}.ckpt"
        ranks = spawn(_streamed_upload, 2, url, str(local_cwd), layers)
        info = fsspec.filesystem("s3").info(url, refresh=True)
        etag = str(info.get("ETag", "")).strip('"')
        assert "-" in etag and int(etag.rsplit("-", 1)[1]) >= 6 * layers // 5, (
            layers,
            etag,
        )  # parts of ~8 MiB
        with fsspec.open(url, "rb") as f:
            ckpt = torch.load(f, weights_only=True)
        _assert_same_state((ckpt["state_dict"], ckpt["optimizer_states"][0]), ranks[0]["state"])
        growth.append(ranks[0]["growth_mib"])
        sizes.append(info["size"] / 2**20)
    assert sizes[1] > sizes[0] + 70, sizes
    assert growth[1] < growth[0] + 12 and growth[1] < 0.5 * sizes[1], (growth, sizes)
